"""What checkpointing a denoising job costs: one capture (the state copied off the
device and serialised), its size, and the slowdown of a job that takes one every
``--every-steps`` steps.

    python bench/checkpoint.py                      # the tiny model on the CPU, in a temporary directory
    python bench/checkpoint.py --model sd15-random --size 512 --steps 25 --device cuda
    python bench/checkpoint.py --model sd15-random --size 512 --images 8 --device cuda   # a job of 8 images
    python bench/checkpoint.py --smoke              # CI's check that it still runs: a few steps, one repeat

The job (of ``--images`` images: one checkpoint holds them all) runs through
``SamplerEngine`` exactly as a worker runs it, with a fixed seed and prompt; the
periodic runs checkpoint by steps alone, and hand each checkpoint to an ``on_checkpoint``
that only keeps its size, so what is measured is the engine's share (the lead's
storing of the bytes comes on top, off the sampling thread). Uninterrupted and
periodic runs alternate, after one warm-up run, so drift hits both alike.

It prints the median seconds of the uninterrupted job, the median capture cost
(ms) and size (bytes) of one checkpoint, the median seconds of the periodic job
and its overhead, and the smallest every-steps whose estimated overhead (captures
per job x capture cost / job time) stays under 3 %: the measured overhead of a
short CPU job is within its run-to-run noise, the estimate is not.
Nothing here is a test."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.denoising.checkpoint_capture import MemberCheckpoints, MemberRun
from gpu_worker.denoising.members import BatchMember
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.registry import ModelRegistry

PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 1234
# The overhead a checkpoint policy may add to a job.
BUDGET = 0.03
SMOKE = {"steps": 6, "every_steps": 2, "repeats": 1, "images": 2, "device": "cpu"}


class TimedCaptures:
    """Wraps every member's capture to time it; the device's queued work is waited
    for first, so a GPU's pending step is not billed to the checkpoint."""

    def __init__(self, engine: SamplerEngine) -> None:
        self.seconds: list[float] = []
        self.sizes: list[int] = []
        self._capture = MemberCheckpoints.capture
        self._cuda = engine.device.type == "cuda"
        timed = self

        def capture(self: MemberCheckpoints, run: MemberRun) -> Checkpoint:
            return timed(self, run)

        MemberCheckpoints.capture = capture  # type: ignore[method-assign]

    def __call__(self, checkpoints: MemberCheckpoints, run: MemberRun) -> Checkpoint:
        if self._cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        taken = self._capture(checkpoints, run)
        self.seconds.append(time.perf_counter() - started)
        self.sizes.append(len(taken.data))
        return taken


def job_seconds(engine: SamplerEngine, req: GenerationParams, kept: list[Checkpoint] | None) -> float:
    on_checkpoint = kept.append if kept is not None else None
    member = BatchMember(req, lambda step, total: None, threading.Event(), on_checkpoint=on_checkpoint)
    started = time.perf_counter()
    [result] = engine.sample_batch([member])
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - started
    if isinstance(result, BaseException):
        raise result
    return took


def smallest_every_steps(steps: int, capture_s: float, job_s: float) -> int | None:
    """The smallest every-steps whose checkpoints (none after the last step) cost
    under BUDGET of the job, or None if even one checkpoint costs more."""
    for every in range(1, steps):
        if (steps - 1) // every * capture_s < BUDGET * job_s:
            return every
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", help="a registry file (default: the default registry)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--scheduler", default="DPMSolverMultistepScheduler", help="'' keeps the model's own")
    parser.add_argument("--size", type=int, default=0, help="width and height (default: the model's)")
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models-dir", help="where builtin models are built (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help=f"CI's quick check: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if not 0 < args.every_steps < args.steps:
        parser.error("--every-steps must be within 1..steps-1")

    registry = ModelRegistry.load(args.registry, presets=None)
    # By steps alone: the model's time-based policy would add checkpoints to a long job.
    spec = replace(registry.get(args.model), scheduler=args.scheduler, checkpoint_every_s=0.0)
    plain = ModelRegistry({args.model: spec})
    periodic = ModelRegistry({args.model: replace(spec, checkpoint_every_steps=args.every_steps)})
    size = args.size or spec.default_width
    req = GenerationParams(args.model, PROMPT, "", size, size, args.steps, 7.5, SEED, args.images)

    with tempfile.TemporaryDirectory(prefix="darkroom-bench-") as scratch:
        engine = SamplerEngine(plain, Path(args.models_dir or scratch), torch.device(args.device))
        engine.load(args.model)
        timed = TimedCaptures(engine)
        job_seconds(engine, req, None)  # warm-up: kernels, caches, the prompt
        bare: list[float] = []
        with_checkpoints: list[float] = []
        kept: list[Checkpoint] = []
        for _ in range(args.repeats):
            engine.registry = plain
            bare.append(job_seconds(engine, req, None))
            engine.registry = periodic
            with_checkpoints.append(job_seconds(engine, req, kept))

    job_s = statistics.median(bare)
    periodic_s = statistics.median(with_checkpoints)
    capture_s = statistics.median(timed.seconds)
    # A job's first capture also builds the fresh scheduler it is compared with.
    mean_capture_s = statistics.fmean(timed.seconds)
    size_b = statistics.median(timed.sizes)
    per_job = (args.steps - 1) // args.every_steps
    # One checkpoint per capture, whatever the job's images: each holds all of them.
    assert len(kept) == per_job * args.repeats, f"{len(kept)} checkpoints kept, {per_job} a job expected"
    assert all(c.total == args.steps for c in kept)
    best = smallest_every_steps(args.steps, mean_capture_s, job_s)

    scheduler = args.scheduler or "the model's own scheduler"
    print(f"# Checkpoints: {args.model}, {size}x{size}, {args.images} image(s), {args.steps} steps, {scheduler}")
    print(f"# {engine.device}, {torch.get_num_threads()} threads, median of {args.repeats} runs\n")
    print(
        "| uninterrupted s | capture ms, median | capture ms, mean | checkpoint bytes | every | "
        "with checkpoints s | overhead | estimated |"
    )
    print("|---|---|---|---|---|---|---|---|")
    estimated = per_job * mean_capture_s / job_s
    print(
        f"| {job_s:.3f} | {capture_s * 1000:.2f} | {mean_capture_s * 1000:.2f} | {size_b:,.0f} | {args.every_steps} | "
        f"{periodic_s:.3f} | {(periodic_s / job_s - 1) * 100:+.1f} % | {estimated * 100:.1f} % |"
    )
    if best is None:
        one = mean_capture_s / job_s
        print(f"\nno every-steps keeps the overhead under {BUDGET:.0%}: one checkpoint costs {one:.1%} of the job")
    else:
        print(f"\nsmallest every-steps under {BUDGET:.0%} overhead (estimated): {best}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
