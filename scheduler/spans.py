"""The scheduler's spans: a job's ``schedule`` span per attempt (``services.telemetry.tracing``)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.trace import SpanKind

from services.db.records import JobRecord, JobSummary
from services.telemetry import tracing


def placed(jobs: Iterable[JobRecord | JobSummary], routings: Mapping[str, Mapping[str, Any]]) -> None:
    """A schedule span for each job just placed and published (its ``routings`` by
    job id): from its submit until now; a retry's from its placement (when it went
    back to the queue is not kept)."""
    on = tracing.active()
    if on is None:
        return
    now = time.time_ns()
    for job in jobs:
        with tracing.contained:
            if (ids := tracing.ids_of(job.trace_context)) is None or job.scheduled_at is None:
                continue
            routing = routings.get(job.id) or {}
            attributes = {
                **tracing.attempt_attributes(job),
                "darkroom.worker.id": job.worker_id or "",
                "darkroom.placement.reason": str(routing.get("reason", "")),
                "darkroom.placement.candidates": len(routing.get("candidates") or ()),
                "darkroom.job.lane": job.lane,
            }
            since = job.created_at if job.attempt <= 1 else job.scheduled_at
            span_id = tracing.schedule_span_id(ids[0], job)
            tracing.emit(
                on, "schedule", (ids[0], span_id), ids[1], tracing.ns(since), now, attributes, SpanKind.PRODUCER
            )
