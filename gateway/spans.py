"""The gateway's spans: a job's trace begins at its submit (``services.telemetry.tracing``)."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from datetime import datetime

from opentelemetry.trace import Link, SpanContext, SpanKind

from services.db.records import JobRecord, NewJob
from services.telemetry import tracing


def with_trace(job: NewJob) -> NewJob:
    """The job with a trace of its own (the root span's context in ``trace_context``)
    if it is sampled; the same job otherwise."""
    on = tracing.active()
    if on is None:
        return job
    with tracing.contained:
        trace_id = random.getrandbits(128) or 1
        if trace_id & (2**64 - 1) < on.sample_below:
            return replace(job, trace_context=tracing.traceparent(trace_id, tracing.new_span_id()))
    return job


def submitted(new: NewJob, job: JobRecord, deduplicated: bool, *, start: datetime) -> None:
    """The root span, once ``new`` (from ``with_trace``) is stored as ``job``. A submit
    answered with an earlier job (the same idempotency key) links to that job's trace."""
    on = tracing.active()
    if on is None:
        return
    with tracing.contained:
        if (ids := tracing.ids_of(new.trace_context)) is None:
            return
        earlier = tracing.ids_of(job.trace_context) if deduplicated else None
        attributes = {
            "rpc.system": "grpc",
            "darkroom.job.id": job.id,
            "darkroom.job.params.model": job.params.model,
            "darkroom.job.lane": job.lane,
            "darkroom.job.pixels": job.params.width * job.params.height,
            "darkroom.job.params.steps": job.params.steps,
            "darkroom.job.images": job.params.num_images,
            "darkroom.deduplicated": deduplicated,
        }
        links = [Link(SpanContext(*earlier, is_remote=True, trace_flags=tracing.SAMPLED))] if earlier else []
        tracing.emit(
            on, tracing.SUBMIT, ids, None, tracing.ns(start), time.time_ns(), attributes, SpanKind.SERVER, links=links
        )
