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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from services.config.sections import KernelSettings
from services.db.records import JobRecord, JobSummary

# What each service process is called in a trace, by its ``run_service`` name.
SERVICE_NAMES = {
    "gateway": "darkroom-gateway",
    "scheduler": "darkroom-scheduler",
    "sampler": "darkroom-sampler",
    "decoder": "darkroom-decoder",
}
SUBMIT = "darkroom.v1.ImageGeneration/SubmitJob"
DECODE = "darkroom.internal.v1.VaeDecoder/Decode"

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = InstrumentationScope("darkroom")
UNSET = Status(StatusCode.UNSET)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exporting:
    processor: BatchSpanProcessor
    resource: Resource
    # Submits whose trace id's low 64 bits are below this are traced (as TraceIdRatioBased).
    sample_below: int


# None: no endpoint, nothing is traced.
_exporting: Exporting | None = None


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
    _exporting = Exporting(BatchSpanProcessor(exporter), resource, round(settings.trace_sample_ratio * 2**64))


def stop() -> None:
    """Exports the spans still queued and stops: at the process's exit, so that the
    last jobs' spans are not lost."""
    global _exporting
    exporting, _exporting = _exporting, None
    if exporting is not None:
        exporting.processor.shutdown()


def exporting() -> bool:
    return _exporting is not None


def active() -> Exporting | None:
    """Where spans go now; None when nothing is traced (the hooks return at once)."""
    return _exporting


# -- building spans: what each service's span hooks (<service>/spans.py) use ---------


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


contained = _Contained()


def emit(
    on: Exporting,
    name: str,
    ids: tuple[int, int],
    parent: int | None,
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any],
    kind: SpanKind = SpanKind.INTERNAL,
    status: Status = UNSET,
    links: Sequence[Link] = (),
) -> None:
    trace_id, span_id = ids
    # The SDK's docs keep ReadableSpan for its own tracer, but its constructor has taken
    # these arguments since 1.0, and building one costs about 3 us against 18 for a
    # tracer's span (2-core development machine), which could not take a chosen id anyway.
    on.processor.on_end(
        ReadableSpan(
            name,
            SpanContext(trace_id, span_id, is_remote=False, trace_flags=SAMPLED),
            # Every parent is another process's span.
            SpanContext(trace_id, parent, is_remote=True, trace_flags=SAMPLED) if parent else None,
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


def attempt_attributes(job: JobRecord | JobSummary) -> dict[str, Any]:
    return {"darkroom.job.id": job.id, "darkroom.job.attempt": job.attempt}


def error_status(error: object) -> Status:
    text = str(error)
    return Status(StatusCode.ERROR, f"{type(error).__name__}: {text}" if text else type(error).__name__)


def schedule_span_id(trace_id: int, job: JobRecord | JobSummary) -> int:
    """The id of the schedule span of the job's current attempt, which the sampler
    computes from the job rather than receives."""
    key = f"{trace_id:032x}/{job.id}/{job.attempt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") or 1


def new_span_id() -> int:
    return random.getrandbits(64) or 1


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def ids_of(traceparent: str | None) -> tuple[int, int] | None:
    """(trace id, span id) of a sampled W3C traceparent; None for anything else."""
    if not traceparent:
        return None
    try:
        _, trace, span, flags = traceparent.split("-")
        ids = int(trace, 16), int(span, 16)
        return ids if int(flags, 16) & 1 and all(ids) else None
    except ValueError:
        return None


def ns(t: datetime) -> int:
    """Nanoseconds since the epoch, exactly (a float of seconds loses microseconds)."""
    return (t - _EPOCH) // _MICROSECOND * 1000
