"""Preemption measured end to end: how soon an urgent job starts when every GPU is
busy with long best-effort work, against the step time of the work it preempts.

    python bench/preemption.py [--samplers 2] [--rounds 5] [--step-ms 100]
    python bench/preemption.py --smoke    # CI's check that it still runs: one sampler, one round

The stack is ``darkroom up``'s (real processes, PostgreSQL, JetStream, the decoder)
with ``DARKROOM_PREEMPTIBLE=video`` and ``DARKROOM_PREEMPTING_LANES=paid``. Its models
are ``sim`` models (services/models/sim.py), so the GPU's time is known exactly: a
``video`` model whose 512 px step takes ``--step-ms``, and a fast ``image`` model.
Each round starts one long video job per sampler (free lane), waits until every one
is sampling, submits one paid image job, and measures, from that submit:
- until a video job was suspended (its suspension's time);
- until the image job started on a GPU, and until it was stored;
- how far the suspended job got, and that it then resumed from there.
The figure that matters is start latency minus one video step: what preempting
costs beyond the step a suspension must wait for. Nothing here is a test."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from services.config.sections import Settings
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc

REGISTRY = """
[models.video]
source = "builtin:sim"
family = "sim"
dtype = "float32"
vram_mb = 1
capability = "video"
max_width = 512
max_height = 512
max_steps = 1000
step_ms_512 = {step_ms}
load_s = 0.01
max_batch = 1
timeout_s = 3600

[models.image]
source = "builtin:sim"
family = "sim"
dtype = "float32"
vram_mb = 1
max_width = 512
max_height = 512
step_ms_512 = 640
load_s = 0.01
"""
SMOKE = {"samplers": 1, "rounds": 1}
TERMINAL = {pb.JOB_STATUS_SUCCEEDED, pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELLED, pb.JOB_STATUS_EXPIRED}


def seconds(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


def wait(client, job_id: str, done, timeout: float = 120.0) -> pb.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = client.GetJob(pb.GetJobRequest(job_id=job_id))
        if done(job):
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job_id}: {job}")
        time.sleep(0.01)


def round_(client, samplers: int, video_steps: int, n: int) -> dict[str, float]:
    videos = [
        client.SubmitJob(
            pb.SubmitJobRequest(
                model="video", prompt=f"video {n}.{i}", width=512, height=512, steps=video_steps, seed=i, lane="free"
            )
        ).job_id
        for i in range(samplers)
    ]
    for job_id in videos:
        wait(client, job_id, lambda j: j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= 3)
    submitted = time.time()
    urgent = client.SubmitJob(
        pb.SubmitJobRequest(model="image", prompt=f"urgent {n}", width=64, height=64, steps=2, lane="paid")
    ).job_id
    image = wait(client, urgent, lambda j: j.status in TERMINAL)
    assert image.status == pb.JOB_STATUS_SUCCEEDED, image.error
    for job_id in videos:
        client.CancelJob(pb.CancelJobRequest(job_id=job_id))
    jobs = [wait(client, job_id, lambda j: j.status in TERMINAL) for job_id in videos]
    suspended = [j for j in jobs if j.suspensions]
    if len(suspended) != 1:
        raise AssertionError(f"{len(suspended)} video jobs were suspended, not 1")
    suspension = suspended[0].suspensions[0]
    return {
        "suspended_s": seconds(suspension.time) - submitted,
        "started_s": seconds(image.timings.started_time) - submitted,
        "stored_s": seconds(image.timings.finished_time) - submitted,
        "at_step": suspension.step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samplers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=100.0, help="one 512 px step of the video model")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    video_steps = int(60_000 / args.step_ms)  # a minute of video work per job

    with tempfile.TemporaryDirectory(prefix="darkroom-preemption-") as tmp:
        registry = Path(tmp) / "registry.toml"
        registry.write_text(REGISTRY.format(step_ms=args.step_ms))
        settings = Settings.from_env(
            {
                "DARKROOM_DATA_DIR": str(Path(tmp) / "stack"),
                "DARKROOM_GATEWAY_PORT": "0",
                "DARKROOM_MODEL_REGISTRY": str(registry),
                "DARKROOM_PRELOAD_MODELS": "video,image",
                "DARKROOM_PREEMPTIBLE": "video",
                "DARKROOM_PREEMPTING_LANES": "paid",
                "DARKROOM_PREEMPT_AFTER_S": "0.5",
                "DARKROOM_MAX_PREEMPTIONS": "1000",
                "DARKROOM_LOG_LEVEL": "WARNING",
            }
        )
        stack = LocalStack(settings, cpu_workers=args.samplers, decoders=1, durable=False)
        stack.start(timeout=180)
        try:
            client = image_generation_pb2_grpc.ImageGenerationStub(grpc.insecure_channel(stack.gateway_address))
            rounds = [round_(client, args.samplers, video_steps, n) for n in range(args.rounds)]
        finally:
            stack.stop()

    step_s = args.step_ms / 1000
    print(f"# Preemption: {args.samplers} samplers, each busy with a {video_steps}-step video job")
    print(f"# (sim, {args.step_ms:g} ms a step); one paid image job per round, {args.rounds} rounds\n")
    print("| round | suspended after s | image started after s | started minus one video step s | stored after s |")
    print("|---|---|---|---|---|")
    for n, r in enumerate(rounds):
        cells = [r["suspended_s"], r["started_s"], r["started_s"] - step_s, r["stored_s"]]
        print(f"| {n + 1} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    started = [r["started_s"] for r in rounds]
    print(
        f"\nimage start after submit: median {statistics.median(started):.3f} s, worst {max(started):.3f} s; "
        f"one video step is {step_s:.3f} s; without preemption it waits for a video job: up to "
        f"{video_steps * step_s:.0f} s"
    )


if __name__ == "__main__":
    main()
