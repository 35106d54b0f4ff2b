"""services.telemetry.tracing without a stack: nothing at all without an endpoint, and with one
(an in-memory exporter) the spans of a job, their parents, times and statuses."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway import spans as gateway_spans
from gpu_worker import spans as sampler_spans
from scheduler import spans as scheduler_spans
from services.config.sections import KernelSettings
from services.db.records import JobRecord
from services.db.states import JobStatus
from services.telemetry import tracing
from tests.records import T0, new_job, record
from vae_worker import spans as decoder_spans


@dataclass
class Member:
    job: JobRecord
    result: object


class Untouchable:
    """Fails the test if a call looks at it: a disabled call must return first."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"looked at .{name}")

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("iterated")


def parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def times(span: ReadableSpan) -> tuple[int, int]:
    assert span.start_time is not None and span.end_time is not None
    return span.start_time, span.end_time


def attrs(span: ReadableSpan) -> Mapping[str, Any]:
    return span.attributes or {}


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.start("sampler", KernelSettings(), exporter=exporter)
    yield exporter
    tracing.stop()


def test_without_an_endpoint_no_exporter_is_made_and_every_call_does_nothing(monkeypatch) -> None:
    import opentelemetry.exporter.otlp.proto.grpc.trace_exporter as otlp

    def no_exporter(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an exporter was made")

    monkeypatch.setattr(otlp, "OTLPSpanExporter", no_exporter)
    tracing.start("gateway", KernelSettings(otlp_endpoint=""))
    assert not tracing.exporting()
    job = new_job()
    assert gateway_spans.with_trace(job) is job
    nothing: Any = Untouchable()
    gateway_spans.submitted(nothing, nothing, False, start=nothing)
    scheduler_spans.placed(nothing, {})
    sampler_spans.sampled(nothing, seconds=1.0, rows=1, worker_id="w")
    sampler_spans.stored(nothing, worker_id="w", decoded_at=nothing, stored=True)
    with sampler_spans.decode_call([record(job)], "d") as traceparents:
        assert traceparents == [None]
    decoder_spans.decoded("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "job-1", start_ns=0)
    tracing.stop()


def test_a_job_s_spans_share_its_trace_and_nest(exported: InMemorySpanExporter) -> None:
    new = gateway_spans.with_trace(new_job())
    assert new.trace_context is not None
    _, trace_hex, root_hex, flags = new.trace_context.split("-")
    assert flags == "01"
    stored = record(new)
    gateway_spans.submitted(new, stored, False, start=T0)
    placed = replace(
        stored,
        status=JobStatus.SCHEDULED,
        attempt=1,
        worker_id="w1",
        scheduled_at=T0 + timedelta(seconds=1),
        routing={"reason": "earliest finish", "candidates": [{}, {}]},
    )
    scheduler_spans.placed([placed], {placed.id: placed.routing or {}})
    running = replace(placed, dispatched_at=T0 + timedelta(seconds=2), started_at=T0 + timedelta(seconds=3))
    sampler_spans.sampled([Member(running, object())], seconds=0.5, rows=1, worker_id="w1")
    with sampler_spans.decode_call([running], "decoder-0") as traceparents:
        [context] = traceparents
        assert context is not None and context.split("-")[1] == trace_hex
        # The decoder's side, from the context that came with the job in the request.
        decoder_spans.decoded(context, "job-1", start_ns=time.time_ns())
    sampler_spans.stored(running, worker_id="w1", decoded_at=datetime.now(UTC), stored=True)
    tracing.stop()  # flushes

    spans = {s.name: s for s in exported.get_finished_spans()}
    assert sorted(spans) == sorted(["schedule", "wait", "sample", "store", tracing.DECODE, tracing.SUBMIT])
    decodes = [s for s in exported.get_finished_spans() if s.name == tracing.DECODE]
    client = next(s for s in decodes if s.kind == SpanKind.CLIENT)
    server = next(s for s in decodes if s.kind == SpanKind.SERVER)
    root, schedule = spans[tracing.SUBMIT], spans["schedule"]
    assert all(f"{s.context.trace_id:032x}" == trace_hex for s in exported.get_finished_spans())
    assert f"{root.context.span_id:016x}" == root_hex and parent(root) is None
    assert parent(schedule) == root.context.span_id
    for name in ("wait", "sample", "store"):
        assert parent(spans[name]) == schedule.context.span_id, name
    assert parent(client) == schedule.context.span_id
    assert parent(server) == client.context.span_id
    assert attrs(server)["darkroom.job.id"] == "job-1"
    for span in (schedule, spans["wait"], spans["sample"], spans["store"], client):
        assert attrs(span)["darkroom.job.id"] == "job-1"
        assert attrs(span)["darkroom.job.attempt"] == 1
    assert attrs(schedule)["darkroom.worker.id"] == "w1"
    assert attrs(schedule)["darkroom.placement.reason"] == "earliest finish"
    assert attrs(schedule)["darkroom.placement.candidates"] == 2
    assert attrs(spans["sample"])["darkroom.batch.images"] == 1
    # Times come from the job's stages, to the microsecond.
    assert root.start_time == tracing.ns(T0) == schedule.start_time
    assert spans["wait"].start_time == tracing.ns(T0 + timedelta(seconds=2))
    assert spans["wait"].end_time == spans["sample"].start_time
    start, end = times(spans["sample"])
    assert end - start == 500_000_000
    assert times(client)[0] <= times(server)[0] <= times(server)[1] <= times(client)[1]
    assert all(s.status.status_code == StatusCode.UNSET for s in exported.get_finished_spans())
    assert {s.resource.attributes["service.name"] for s in exported.get_finished_spans()} == {"darkroom-sampler"}


def test_failures_mark_their_span(exported: InMemorySpanExporter) -> None:
    new = gateway_spans.with_trace(new_job())
    job = replace(record(new), attempt=2, scheduled_at=T0, started_at=T0)
    sampler_spans.sampled([Member(job, RuntimeError("CUDA error"))], seconds=0.1, rows=1, worker_id="w1")
    with pytest.raises(ValueError), sampler_spans.decode_call([job], "decoder-0"):
        raise ValueError("gone")
    tracing.stop()
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert spans["sample"].status.status_code == StatusCode.ERROR
    assert spans["sample"].status.description == "RuntimeError: CUDA error"
    assert spans[tracing.DECODE].status.description == "ValueError: gone"
    assert spans["wait"].status.status_code == StatusCode.UNSET


def test_a_retry_s_schedule_span_is_its_own(exported: InMemorySpanExporter) -> None:
    new = gateway_spans.with_trace(new_job())
    first = replace(record(new), attempt=1, scheduled_at=T0 + timedelta(seconds=1))
    second = replace(first, attempt=2, scheduled_at=T0 + timedelta(seconds=9))
    scheduler_spans.placed([first, second], {})
    tracing.stop()
    a, b = exported.get_finished_spans()
    assert a.context.span_id != b.context.span_id
    assert a.start_time == tracing.ns(T0) and b.start_time == tracing.ns(T0 + timedelta(seconds=9))


def test_untraced_jobs_are_skipped_and_the_ratio_samples(exported: InMemorySpanExporter) -> None:
    untraced = record(new_job(), attempt=1, scheduled_at=T0)
    scheduler_spans.placed([untraced], {})
    sampler_spans.sampled([Member(untraced, None)], seconds=0.1, rows=1, worker_id="w1")
    with sampler_spans.decode_call([untraced], "decoder-0") as traceparents:
        assert traceparents == [None]
    never = InMemorySpanExporter()
    tracing.start("gateway", KernelSettings(trace_sample_ratio=0.0), exporter=never)
    job = new_job()
    assert all(gateway_spans.with_trace(job) is job for _ in range(100))
    tracing.stop()
    assert exported.get_finished_spans() == () and never.get_finished_spans() == ()


def test_stop_exports_what_is_queued(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # never by the clock
    exporter = InMemorySpanExporter()
    tracing.start("scheduler", KernelSettings(), exporter=exporter)
    new = gateway_spans.with_trace(new_job())
    scheduler_spans.placed([replace(record(new), attempt=1, scheduled_at=T0)], {})
    assert exporter.get_finished_spans() == ()
    tracing.stop()
    [span] = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "darkroom-scheduler"


def test_an_error_in_a_hook_loses_its_span_not_the_job(exported: InMemorySpanExporter, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="darkroom.tracing")  # only the first is a warning
    new = gateway_spans.with_trace(new_job())
    naive = datetime(2020, 1, 1)  # cannot be compared with the aware epoch: the hook fails inside
    good = replace(record(new), attempt=1, scheduled_at=T0)
    scheduler_spans.placed([replace(good, created_at=naive), good], {})
    sampler_spans.stored(good, worker_id="w1", decoded_at=naive, stored=True)
    tracing.stop()
    [span] = exported.get_finished_spans()
    assert span.name == "schedule" and span.start_time == tracing.ns(T0)
    assert "a span was dropped" in caplog.text
