"""The decoder's span of each job it decodes, a child of the sampler's call (``services.telemetry.tracing``)."""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, Status, StatusCode

from services.telemetry import tracing


def decoded(traceparent: str, job_id: str, *, start_ns: int, error: str = "") -> None:
    """The decoder's span of one job of a ``Decode`` call, from the call's start until
    now: a child of the sampler's client span whose context came with the job."""
    on = tracing.active()
    if on is None or not traceparent:
        return
    with tracing.contained:
        if (parent := tracing.ids_of(traceparent)) is None:
            return
        attributes = {"rpc.system": "grpc", "darkroom.job.id": job_id}
        status = Status(StatusCode.ERROR, error) if error else tracing.UNSET
        ids = (parent[0], tracing.new_span_id())
        tracing.emit(on, tracing.DECODE, ids, parent[1], start_ns, time.time_ns(), attributes, SpanKind.SERVER, status)
