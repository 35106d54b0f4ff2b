"""What Darkroom adds to a job that makes its image in milliseconds (issue 46): the
tiny model's jobs (64 px, 1 step, one image) sent one after another through the
stack ``darkroom up`` runs (a durable PostgreSQL, JetStream on disk, the default
safety settings: the prompt filter and the image filter on every output), each
followed to its last image byte through ``StreamJob``. Client time minus the job's
own sampling stage is the platform's cost; its stages say where it goes, and each
service's CPU, statements and messages per job say what it costs.

    python bench/latency_probe.py                 # 60 jobs after 10 to warm up
    python bench/latency_probe.py --smoke         # CI's check that it still runs

The targets (issue 46): client time minus sampling at most 10 ms p50 and 20 ms p99
on the 2-core machine, and at most 1 ms of CPU per job for each of the gateway,
scheduler, sampler and decoder's own bookkeeping. Nothing here is a test."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.support import service_costs
from services.config.sections import Settings
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.telemetry.stages import STAGES

MODEL = "tiny"
SMOKE = {"jobs": 5, "warmup": 2}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def one_job(client: object, index: int, size: int, steps: int) -> tuple[float, pb.Job]:
    """Client seconds, submit to the terminal event (its image with it), and the job."""
    request = pb.SubmitJobRequest(model=MODEL, prompt=f"a lighthouse, {index}", width=size, height=size, steps=steps)
    started = time.perf_counter()
    job_id = client.SubmitJob(request).job_id  # type: ignore[attr-defined]
    received = 0
    for event in client.StreamJob(pb.StreamJobRequest(job_id=job_id)):  # type: ignore[attr-defined]
        received += len(event.image_chunk.data)
        if event.HasField("terminal"):
            took = time.perf_counter() - started  # the image's bytes came before it
            if event.terminal.status != pb.JOB_STATUS_SUCCEEDED or not received:
                raise SystemExit(f"job {job_id} ended {event.terminal.status}: {event.terminal.error}")
            return took, event.terminal
    raise SystemExit(f"job {job_id}: the stream ended without a terminal event")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="jobs first, not counted")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--data-dir", help="where the stack keeps its data (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help=f"CI's quick check: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)

    data_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="darkroom-bench-"))
    settings = Settings.from_env(
        {
            "DARKROOM_DATA_DIR": str(data_dir),
            "DARKROOM_GATEWAY_PORT": "0",
            "DARKROOM_PRELOAD_MODELS": MODEL,
            "DARKROOM_LOG_LEVEL": "WARNING",
        }
    )
    stack = LocalStack(settings, durable=True)
    stack.start(timeout=600)
    try:
        from tests.helpers import stub

        client = stub(stack)
        for i in range(args.warmup):
            one_job(client, -1 - i, args.size, args.steps)
        before = service_costs.read(stack)
        runs = [one_job(client, i, args.size, args.steps) for i in range(args.jobs)]
        after = service_costs.read(stack)
    finally:
        stack.stop()

    client_ms = [took * 1000 for took, _ in runs]
    added = [(took - job.stage_durations.sample_seconds) * 1000 for took, job in runs]
    stages = {
        stage: statistics.median(getattr(job.stage_durations, f"{stage}_seconds") * 1000 for _, job in runs)
        for stage in STAGES
    }
    print(f"# {args.jobs} sequential {MODEL} jobs, {args.size} px, {args.steps} step(s), `darkroom up`'s stack\n")
    head = "| jobs | client p50 ms | client p99 ms | client minus sampling p50 ms | p99 ms | "
    print(head + " | ".join(STAGES) + " |")
    print("|" + "---|" * (5 + len(STAGES)))
    print(
        f"| {args.jobs} | {percentile(client_ms, 50):.1f} | {percentile(client_ms, 99):.1f} | "
        f"{percentile(added, 50):.1f} | {percentile(added, 99):.1f} | "
        + " | ".join(f"{stages[s]:.1f}" for s in STAGES)
        + " |\n"
    )
    print("stage columns: medians in ms from each job's own stage durations\n")
    print(service_costs.HEADER)
    print("|---|---|---|---|---|")
    print("\n".join(service_costs.table_rows(service_costs.per_job(before, after, len(runs)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
