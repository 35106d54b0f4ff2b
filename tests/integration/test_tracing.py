"""A job's trace across the real stack: every service exports its spans over OTLP/gRPC
to a collector run here, and the spans of one job form one trace, nested as the job
travelled, with times that agree with its stages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.telemetry import tracing
from tests.conftest import make_stack
from tests.helpers import stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# datetime keeps microseconds; spans timed by time.time_ns() may sit up to one later.
US = 1000


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, Any]
    error: bool


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OpenTelemetry collector's trace endpoint, keeping what it receives."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self.endpoint = ""

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any) -> Any:
        got = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(
                        Span(
                            service=resource.get("service.name", ""),
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                        )
                    )
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_job(self, job_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if s.attributes.get("darkroom.job.id") == job_id]


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    c.endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield c
    server.stop(0)


EXPECTED = {
    ("darkroom-gateway", tracing.SUBMIT),
    ("darkroom-scheduler", "schedule"),
    ("darkroom-sampler", "wait"),
    ("darkroom-sampler", "sample"),
    ("darkroom-sampler", tracing.DECODE),
    ("darkroom-decoder", tracing.DECODE),
    ("darkroom-sampler", "store"),
}


def test_a_job_s_spans_from_the_four_services_form_its_trace(
    tmp_path: Path,
    postgres: EmbeddedPostgres,
    models_dir: Path,
    collector: Collector,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the services' children inherit it
    stack = make_stack(tmp_path, postgres, models_dir, otlp_endpoint=collector.endpoint)
    try:
        stack.start()
        client = stub(stack)
        reply = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="a traced fox", width=64, height=64, steps=3))
        job = wait_terminal(client, reply.job_id)
        assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
        spans = wait_for(
            lambda: collector.of_job(reply.job_id),
            lambda got: EXPECTED <= {(s.service, s.name) for s in got},
            timeout=30,
            what="the spans of every service",
        )
        with psycopg.connect(stack.pg_url) as conn:
            row = conn.execute("SELECT trace_context FROM jobs WHERE id = %s", (reply.job_id,)).fetchone()
    finally:
        stack.stop()

    assert len(spans) == len(EXPECTED), sorted((s.service, s.name) for s in spans)
    by = {(s.service, s.name): s for s in spans}
    root = by["darkroom-gateway", tracing.SUBMIT]
    schedule = by["darkroom-scheduler", "schedule"]
    wait, sample, store = (by["darkroom-sampler", name] for name in ("wait", "sample", "store"))
    client_call, served = by["darkroom-sampler", tracing.DECODE], by["darkroom-decoder", tracing.DECODE]

    # One trace, whose root's context is what the gateway stored with the job.
    assert row is not None and row[0] == f"00-{root.trace_id}-{root.span_id}-01"
    assert {s.trace_id for s in spans} == {root.trace_id}
    assert not any(s.error for s in spans)
    # Nested as the job travelled: the decoder's span is the child of the sampler's call.
    assert root.parent_id == "" and root.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert schedule.parent_id == root.span_id
    for span in (wait, sample, client_call, store):
        assert span.parent_id == schedule.span_id, span.name
    assert served.parent_id == client_call.span_id
    assert (client_call.kind, served.kind) == (trace_pb2.Span.SPAN_KIND_CLIENT, trace_pb2.Span.SPAN_KIND_SERVER)
    # What each says of the job.
    for span in (schedule, wait, sample, client_call, store):
        assert span.attributes["darkroom.job.attempt"] == 1, span.name
    assert schedule.attributes["darkroom.worker.id"] == job.worker_id
    assert schedule.attributes["darkroom.placement.reason"] == job.routing.reason
    assert sample.attributes["darkroom.worker.id"] == job.worker_id
    assert (sample.attributes["darkroom.batch.jobs"], sample.attributes["darkroom.batch.images"]) == (1, 1)
    assert store.attributes["darkroom.stored"] is True
    # Times: each span in order, and the stages GetJob reports inside them.
    assert all(s.start <= s.end for s in spans)
    t = job.timings
    assert root.start == schedule.start == t.created_time.ToNanoseconds()
    assert root.end <= schedule.end and t.scheduled_time.ToNanoseconds() <= schedule.end
    assert schedule.start <= wait.start <= schedule.end
    assert t.started_time.ToNanoseconds() <= wait.end + US and wait.end == sample.start
    assert sample.end <= t.decoding_time.ToNanoseconds() + US
    assert sample.end <= client_call.start <= served.start <= served.end <= client_call.end
    assert client_call.end <= store.start + US
    assert t.finished_time.ToNanoseconds() <= store.end


def test_a_service_s_last_spans_are_exported_as_it_stops(tmp_path: Path, collector: Collector) -> None:
    job_id = str(uuid.uuid4())
    ready = tmp_path / "ready"
    env = {
        **os.environ,
        "DARKROOM_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "600000",  # not by the clock: only when the process stops
        "TRACED_JOB_ID": job_id,
        "TRACED_READY": str(ready),
    }
    child = subprocess.Popen([sys.executable, "-m", "tests.integration.children.traced_exit"], cwd=ROOT, env=env)
    try:
        wait_for(lambda: ready.exists() or child.poll() is not None, bool, timeout=60, what="the child to emit")
        assert child.poll() is None, "the child exited early"
        assert collector.of_job(job_id) == []
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    [span] = collector.of_job(job_id)
    assert (span.service, span.name) == ("darkroom-scheduler", tracing.DECODE)
