"""The sampler's spans: a job's wait, its sampling, each decode call and the store (``services.telemetry.tracing``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from opentelemetry.trace import SpanKind

from services.db.records import JobRecord
from services.telemetry import tracing


class Sampled(Protocol):
    """A job of a batch as the sampler holds it: the job, and what sampling left
    (its latents, or the exception that ended it)."""

    @property
    def job(self) -> JobRecord: ...

    @property
    def result(self) -> object: ...


def sampled(batch: Sequence[Sampled], *, seconds: float, rows: int, worker_id: str) -> None:
    """Just after a batch sampled for ``seconds``: each job's wait (from its publish
    until the batch began) and its sampling, with the batch's size."""
    on = tracing.active()
    if on is None:
        return
    end = time.time_ns()
    began = end - round(seconds * 1e9)
    for member in batch:
        with tracing.contained:
            job = member.job
            if (ids := tracing.ids_of(job.trace_context)) is None:
                continue
            parent = tracing.schedule_span_id(ids[0], job)
            attributes = {**tracing.attempt_attributes(job), "darkroom.worker.id": worker_id}
            if since := job.dispatched_at or job.started_at:
                tracing.emit(
                    on,
                    "wait",
                    (ids[0], tracing.new_span_id()),
                    parent,
                    tracing.ns(since),
                    began,
                    attributes,
                    SpanKind.CONSUMER,
                )
            sampling = {
                **attributes,
                "darkroom.job.params.model": job.params.model,
                "darkroom.job.pixels": job.params.width * job.params.height,
                "darkroom.job.params.steps": job.params.steps,
                "darkroom.batch.jobs": len(batch),
                "darkroom.batch.images": rows,
            }
            status = tracing.error_status(member.result) if isinstance(member.result, BaseException) else tracing.UNSET
            tracing.emit(on, "sample", (ids[0], tracing.new_span_id()), parent, began, end, sampling, status=status)


def decode_call(jobs: Sequence[JobRecord], decoder_id: str) -> _DecodeCall:
    """Around one ``Decode`` call for ``jobs`` (a sampler's batch): a client span in
    each traced job's trace, and, per job, the context the decoder's span of it
    takes as its parent (None for a job not traced)."""
    on = tracing.active()
    if on is None:
        return _DecodeCall(None, [None] * len(jobs))
    calls: list[tuple[tuple[int, int], int, dict[str, Any]] | None] = []
    for job in jobs:
        with tracing.contained:
            if (ids := tracing.ids_of(job.trace_context)) is not None:
                attributes = {
                    "rpc.system": "grpc",
                    **tracing.attempt_attributes(job),
                    "darkroom.decoder.id": decoder_id,
                }
                calls.append(((ids[0], tracing.new_span_id()), tracing.schedule_span_id(ids[0], job), attributes))
                continue
        calls.append(None)
    return _DecodeCall(on, calls)


class _DecodeCall:
    def __init__(self, on: tracing.Exporting | None, calls: list[tuple[tuple[int, int], int, dict[str, Any]] | None]):
        self.on, self.calls = on, calls
        self.start = 0

    def __enter__(self) -> list[str | None]:
        self.start = time.time_ns()
        return [tracing.traceparent(*call[0]) if call is not None else None for call in self.calls]

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if self.on is None:
            return
        end = time.time_ns()
        status = tracing.error_status(error) if error is not None else tracing.UNSET
        for call in self.calls:
            if call is not None:
                with tracing.contained:
                    ids, parent, attributes = call
                    tracing.emit(
                        self.on, tracing.DECODE, ids, parent, self.start, end, attributes, SpanKind.CLIENT, status
                    )


def stored(job: JobRecord, *, worker_id: str, decoded_at: datetime, stored: bool) -> None:
    """Just after the job's images and SUCCEEDED were written (``stored``: the attempt
    was still the job's own), from when its decode ended."""
    on = tracing.active()
    if on is None:
        return
    with tracing.contained:
        if (ids := tracing.ids_of(job.trace_context)) is None:
            return
        attributes = {**tracing.attempt_attributes(job), "darkroom.worker.id": worker_id, "darkroom.stored": stored}
        parent = tracing.schedule_span_id(ids[0], job)
        tracing.emit(
            on, "store", (ids[0], tracing.new_span_id()), parent, tracing.ns(decoded_at), time.time_ns(), attributes
        )
