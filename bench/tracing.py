"""What tracing costs the services: each hook of ``services.telemetry.tracing`` per call with no
endpoint (it must be next to nothing) and with one, and the whole cost of a job's
sampler spans to the process, OTLP export included, with a collector in another
process.

    python bench/tracing.py [--calls N] [--jobs N] [--rate JOBS_PER_S]
    python bench/tracing.py --smoke    # CI's check that it still runs: 200 calls a hook, 200 jobs
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import timeit
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gateway import spans as gateway_spans
from gpu_worker import spans as sampler_spans
from scheduler import spans as scheduler_spans
from services.config.sections import KernelSettings
from services.db.records import JobRecord, NewJob
from services.db.states import JobStatus
from services.generation import GenerationParams
from services.telemetry import tracing
from vae_worker import spans as decoder_spans

SMOKE = {"calls": 200, "jobs": 200}


class Discard(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


@dataclass
class Member:
    job: JobRecord
    result: object


def a_job() -> tuple[NewJob, JobRecord]:
    new = gateway_spans.with_trace(
        NewJob("0" * 36, "free", 0, GenerationParams("tiny", "p", "", 512, 512, 20, 7.5, 1, 1), None)
    )
    now = datetime.now(UTC)
    fields = {k: v for k, v in new.__dict__.items() if k in JobRecord.__dataclass_fields__}
    job = JobRecord(
        **fields,
        status=JobStatus.RUNNING,
        attempt=1,
        worker_id="host-gpu0",
        error="",
        progress_step=0,
        progress_total=20,
        routing={"reason": "earliest estimated finish", "candidates": [{}, {}]},
        cancel_requested=False,
        created_at=now - timedelta(seconds=1),
        scheduled_at=now - timedelta(seconds=0.9),
        started_at=now - timedelta(seconds=0.5),
        decoding_at=None,
        finished_at=None,
        dispatched_at=now - timedelta(seconds=0.8),
    )
    return new, job


def hooks() -> dict[str, Callable[[], object]]:
    """One call of each hook, as the services make it (a batch of one job)."""
    new, job = a_job()
    members = [Member(job, None)]
    traceparent = job.trace_context or "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    now = datetime.now(UTC)

    def decode_call() -> None:
        with sampler_spans.decode_call([job], "host-decoder0"):
            pass

    return {
        "gateway with_trace": lambda: gateway_spans.with_trace(new),
        "gateway submitted": lambda: gateway_spans.submitted(new, job, False, start=now),
        "scheduler placed (1 job)": lambda: scheduler_spans.placed(
            [job], {job.id: {"reason": "earliest finish", "candidates": [{}]}}
        ),
        "sampler sampled (1 job)": lambda: sampler_spans.sampled(members, seconds=0.4, rows=1, worker_id="host-gpu0"),
        "sampler decode_call": decode_call,
        "sampler stored": lambda: sampler_spans.stored(job, worker_id="host-gpu0", decoded_at=now, stored=True),
        "decoder decoded (1 job)": lambda: decoder_spans.decoded(traceparent, job.id, start_ns=time.time_ns()),
    }


def per_call_ns(call: Callable[[], object], calls: int) -> float:
    return min(timeit.repeat(call, number=calls, repeat=5)) / calls * 1e9


def collector(port: Any) -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Drop(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Drop(), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    server.wait_for_termination()


def process_cost_per_job_us(jobs: int, rate: float) -> float:
    """CPU time of this process (every thread: the hooks, the batch processor,
    encoding, gRPC) per job for a sampler's spans of it (wait, sample, decode, store)."""
    port = multiprocessing.Value("i", 0)
    receiver = multiprocessing.Process(target=collector, args=(port,), daemon=True)
    receiver.start()
    while not port.value:
        time.sleep(0.01)
    tracing.start("sampler", KernelSettings(otlp_endpoint=f"http://127.0.0.1:{port.value}"))
    calls = hooks()
    sampler = [calls[name] for name in ("sampler sampled (1 job)", "sampler decode_call", "sampler stored")]
    began, clock = time.process_time(), time.monotonic()
    for i in range(jobs):
        for call in sampler:
            call()
        if i % 100 == 99:  # at `rate` jobs a second, as a loaded sampler would
            time.sleep(max(0.0, clock + (i + 1) / rate - time.monotonic()))
    tracing.stop()  # exports the rest
    spent = time.process_time() - began
    receiver.kill()
    return spent / jobs * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=1000.0, help="jobs a second for the whole-process figure")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)

    tracing.stop()
    off = {name: per_call_ns(call, args.calls) for name, call in hooks().items()}
    # Room for every span: a full queue drops, and logs each one it drops.
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(10 * args.calls * len(off))
    tracing.start("sampler", KernelSettings(), exporter=Discard())
    on = {name: per_call_ns(call, args.calls) for name, call in hooks().items()}
    tracing.stop()
    del os.environ["OTEL_BSP_MAX_QUEUE_SIZE"]
    print(f"Per call, on the caller's thread, best of 5 x {args.calls} calls:\n")
    print("| hook | no endpoint | endpoint |")
    print("|---|---|---|")
    for name in off:
        print(f"| {name} | {off[name]:.0f} ns | {on[name] / 1000:.1f} us |")
    print()
    total = process_cost_per_job_us(args.jobs, args.rate)
    print(
        f"sampler at {args.rate:.0f} jobs/s, whole process, OTLP export included: {total:.0f} us of CPU per job "
        f"(4 spans), {total * args.rate / 1e4:.1f} % of a core"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
