"""A trace of each job across the services (OpenTelemetry, exported over OTLP/gRPC
to ``DARKROOM_OTLP_ENDPOINT``; with none set, every hook here returns at its first
line). A job's spans:

    darkroom.v1.ImageGeneration/SubmitJob          gateway: the root
    └─ schedule                                    scheduler: queued, placed, published
       ├─ wait                                     sampler: from publish until its batch samples
       ├─ sample                                   sampler: the batch's denoising loop
       ├─ darkroom.internal.v1.VaeDecoder/Decode   sampler: each decoder tried (a call decodes a batch)
       │  └─ darkroom.internal.v1.VaeDecoder/Decode   decoder: its parent comes with the job in the request
       └─ store                                    sampler: images and SUCCEEDED written

Every span is built finished, once its end is known, from times the code keeps anyway
(the job's stage times, a measured duration), and handed to the batch processor: the
hot paths make one call, and the SDK's tracer, which cannot choose a span's id in
advance, is not needed. The gateway stores the root's W3C ``traceparent`` in
``jobs.trace_context``, for sampled jobs only, so other services trace exactly the
jobs that have one. A schedule span's id is derived from the job and its attempt:
the sampler names it as its spans' parent with nothing added to the dispatch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from services.config.sections import KernelSettings
from services.db.records import JobRecord, JobSummary, NewJob

# What each service process is called in a trace, by its ``run_service`` name.
SERVICE_NAMES = {
    "gateway": "darkroom-gateway",
    "scheduler": "darkroom-scheduler",
    "sampler": "darkroom-sampler",
    "decoder": "darkroom-decoder",
}
SUBMIT = "darkroom.v1.ImageGeneration/SubmitJob"
DECODE = "darkroom.internal.v1.VaeDecoder/Decode"

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("darkroom")
_UNSET = Status(StatusCode.UNSET)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Exporting:
    processor: BatchSpanProcessor
    resource: Resource
    # Submits whose trace id's low 64 bits are below this are traced (as TraceIdRatioBased).
    sample_below: int


# None: no endpoint, nothing is traced.
_exporting: _Exporting | None = None


def start(process: str, settings: KernelSettings, *, exporter: SpanExporter | None = None) -> None:
    """Sets up this process's export, once at its start; nothing at all without an
    endpoint. ``exporter`` replaces the OTLP one (tests). The ``OTEL_BSP_*`` and
    ``OTEL_EXPORTER_OTLP_*`` variables (delay, queue, headers, certificates) apply."""
    global _exporting
    stop()
    if exporter is None:
        if not settings.otlp_endpoint:
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint)
    resource = Resource.create(
        {
            "service.name": SERVICE_NAMES.get(process, process),
            "service.namespace": "darkroom",
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
        }
    )
    _exporting = _Exporting(BatchSpanProcessor(exporter), resource, round(settings.trace_sample_ratio * 2**64))


def stop() -> None:
    """Exports the spans still queued and stops: at the process's exit, so that the
    last jobs' spans are not lost."""
    global _exporting
    exporting, _exporting = _exporting, None
    if exporting is not None:
        exporting.processor.shutdown()


def exporting() -> bool:
    return _exporting is not None


# -- the gateway -------------------------------------------------------------------


def with_trace(job: NewJob) -> NewJob:
    """The job with a trace of its own (the root span's context in ``trace_context``)
    if it is sampled; the same job otherwise."""
    on = _exporting
    if on is None:
        return job
    with _contained:
        trace_id = random.getrandbits(128) or 1
        if trace_id & (2**64 - 1) < on.sample_below:
            return replace(job, trace_context=_traceparent(trace_id, _new_span_id()))
    return job


def submitted(new: NewJob, job: JobRecord, deduplicated: bool, *, start: datetime) -> None:
    """The root span, once ``new`` (from ``with_trace``) is stored as ``job``. A submit
    answered with an earlier job (the same idempotency key) links to that job's trace."""
    on = _exporting
    if on is None:
        return
    with _contained:
        if (ids := _ids(new.trace_context)) is None:
            return
        earlier = _ids(job.trace_context) if deduplicated else None
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
        links = [Link(SpanContext(*earlier, is_remote=True, trace_flags=_SAMPLED))] if earlier else []
        _emit(on, SUBMIT, ids, None, _ns(start), time.time_ns(), attributes, SpanKind.SERVER, links=links)


# -- the scheduler -----------------------------------------------------------------


def placed(jobs: Iterable[JobRecord | JobSummary], routings: Mapping[str, Mapping[str, Any]]) -> None:
    """A schedule span for each job just placed and published (its ``routings`` by
    job id): from its submit until now; a retry's from its placement (when it went
    back to the queue is not kept)."""
    on = _exporting
    if on is None:
        return
    now = time.time_ns()
    for job in jobs:
        with _contained:
            if (ids := _ids(job.trace_context)) is None or job.scheduled_at is None:
                continue
            routing = routings.get(job.id) or {}
            attributes = {
                **_attempt(job),
                "darkroom.worker.id": job.worker_id or "",
                "darkroom.placement.reason": str(routing.get("reason", "")),
                "darkroom.placement.candidates": len(routing.get("candidates") or ()),
                "darkroom.job.lane": job.lane,
            }
            since = job.created_at if job.attempt <= 1 else job.scheduled_at
            span_id = _schedule_span_id(ids[0], job)
            _emit(on, "schedule", (ids[0], span_id), ids[1], _ns(since), now, attributes, SpanKind.PRODUCER)


# -- the sampler -------------------------------------------------------------------


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
    on = _exporting
    if on is None:
        return
    end = time.time_ns()
    began = end - round(seconds * 1e9)
    for member in batch:
        with _contained:
            job = member.job
            if (ids := _ids(job.trace_context)) is None:
                continue
            parent = _schedule_span_id(ids[0], job)
            attributes = {**_attempt(job), "darkroom.worker.id": worker_id}
            if since := job.dispatched_at or job.started_at:
                _emit(on, "wait", (ids[0], _new_span_id()), parent, _ns(since), began, attributes, SpanKind.CONSUMER)
            sampling = {
                **attributes,
                "darkroom.job.params.model": job.params.model,
                "darkroom.job.pixels": job.params.width * job.params.height,
                "darkroom.job.params.steps": job.params.steps,
                "darkroom.batch.jobs": len(batch),
                "darkroom.batch.images": rows,
            }
            status = _status(member.result) if isinstance(member.result, BaseException) else _UNSET
            _emit(on, "sample", (ids[0], _new_span_id()), parent, began, end, sampling, status=status)


def decode_call(jobs: Sequence[JobRecord], decoder_id: str) -> _DecodeCall:
    """Around one ``Decode`` call for ``jobs`` (a sampler's batch): a client span in
    each traced job's trace, and, per job, the context the decoder's span of it
    takes as its parent (None for a job not traced)."""
    on = _exporting
    if on is None:
        return _DecodeCall(None, [None] * len(jobs))
    calls: list[tuple[tuple[int, int], int, dict[str, Any]] | None] = []
    for job in jobs:
        with _contained:
            if (ids := _ids(job.trace_context)) is not None:
                attributes = {"rpc.system": "grpc", **_attempt(job), "darkroom.decoder.id": decoder_id}
                calls.append(((ids[0], _new_span_id()), _schedule_span_id(ids[0], job), attributes))
                continue
        calls.append(None)
    return _DecodeCall(on, calls)


class _DecodeCall:
    def __init__(self, on: _Exporting | None, calls: list[tuple[tuple[int, int], int, dict[str, Any]] | None]):
        self.on, self.calls = on, calls
        self.start = 0

    def __enter__(self) -> list[str | None]:
        self.start = time.time_ns()
        return [_traceparent(*call[0]) if call is not None else None for call in self.calls]

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if self.on is None:
            return
        end = time.time_ns()
        status = _status(error) if error is not None else _UNSET
        for call in self.calls:
            if call is not None:
                with _contained:
                    ids, parent, attributes = call
                    _emit(self.on, DECODE, ids, parent, self.start, end, attributes, SpanKind.CLIENT, status)


def decoded(traceparent: str, job_id: str, *, start_ns: int, error: str = "") -> None:
    """The decoder's span of one job of a ``Decode`` call, from the call's start until
    now: a child of the sampler's client span whose context came with the job."""
    on = _exporting
    if on is None or not traceparent:
        return
    with _contained:
        if (parent := _ids(traceparent)) is None:
            return
        attributes = {"rpc.system": "grpc", "darkroom.job.id": job_id}
        status = Status(StatusCode.ERROR, error) if error else _UNSET
        ids = (parent[0], _new_span_id())
        _emit(on, DECODE, ids, parent[1], start_ns, time.time_ns(), attributes, SpanKind.SERVER, status)


def stored(job: JobRecord, *, worker_id: str, decoded_at: datetime, stored: bool) -> None:
    """Just after the job's images and SUCCEEDED were written (``stored``: the attempt
    was still the job's own), from when its decode ended."""
    on = _exporting
    if on is None:
        return
    with _contained:
        if (ids := _ids(job.trace_context)) is None:
            return
        attributes = {**_attempt(job), "darkroom.worker.id": worker_id, "darkroom.stored": stored}
        parent = _schedule_span_id(ids[0], job)
        _emit(on, "store", (ids[0], _new_span_id()), parent, _ns(decoded_at), time.time_ns(), attributes)


# -- the decoder -------------------------------------------------------------------


# -- building spans ----------------------------------------------------------------


class _Contained:
    """Tracing never fails what it traces: an error in a hook loses its span, is
    logged (in full the first time), and the job, the pass or the call goes on."""

    dropped = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> bool:
        if not isinstance(error, Exception):
            return False
        _Contained.dropped += 1
        log.log(
            logging.WARNING if _Contained.dropped == 1 else logging.DEBUG,
            "a span was dropped (%d so far): %s",
            _Contained.dropped,
            error,
            exc_info=_Contained.dropped == 1,
        )
        return True


_contained = _Contained()


def _emit(
    on: _Exporting,
    name: str,
    ids: tuple[int, int],
    parent: int | None,
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any],
    kind: SpanKind = SpanKind.INTERNAL,
    status: Status = _UNSET,
    links: Sequence[Link] = (),
) -> None:
    trace_id, span_id = ids
    # The SDK's docs keep ReadableSpan for its own tracer, but its constructor has taken
    # these arguments since 1.0, and building one costs about 3 us against 18 for a
    # tracer's span (2-core development machine), which could not take a chosen id anyway.
    on.processor.on_end(
        ReadableSpan(
            name,
            SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED),
            # Every parent is another process's span.
            SpanContext(trace_id, parent, is_remote=True, trace_flags=_SAMPLED) if parent else None,
            on.resource,
            attributes,
            links=links,
            kind=kind,
            status=status,
            start_time=start_ns,
            # Times from two machines' clocks may disagree: a span never ends before it starts.
            end_time=max(start_ns, end_ns),
            instrumentation_scope=_SCOPE,
        )
    )


def _attempt(job: JobRecord | JobSummary) -> dict[str, Any]:
    return {"darkroom.job.id": job.id, "darkroom.job.attempt": job.attempt}


def _status(error: object) -> Status:
    text = str(error)
    return Status(StatusCode.ERROR, f"{type(error).__name__}: {text}" if text else type(error).__name__)


def _schedule_span_id(trace_id: int, job: JobRecord | JobSummary) -> int:
    """The id of the schedule span of the job's current attempt, which the sampler
    computes from the job rather than receives."""
    key = f"{trace_id:032x}/{job.id}/{job.attempt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") or 1


def _new_span_id() -> int:
    return random.getrandbits(64) or 1


def _traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def _ids(traceparent: str | None) -> tuple[int, int] | None:
    """(trace id, span id) of a sampled W3C traceparent; None for anything else."""
    if not traceparent:
        return None
    try:
        _, trace, span, flags = traceparent.split("-")
        ids = int(trace, 16), int(span, 16)
        return ids if int(flags, 16) & 1 and all(ids) else None
    except ValueError:
        return None


def _ns(t: datetime) -> int:
    """Nanoseconds since the epoch, exactly (a float of seconds loses microseconds)."""
    return (t - _EPOCH) // _MICROSECOND * 1000
