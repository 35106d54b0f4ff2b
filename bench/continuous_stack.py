"""Continuous batching against batch-at-start through the whole stack (issue 35): the
simulator's comparison (``bench/continuous_batching.py``) on real processes.

    python bench/continuous_stack.py                  # on a GPU: sd15-random at 512 px, steps 20/30/50
    python bench/continuous_stack.py --device cpu     # on a CPU: the tiny model at 96 px, steps 8/12/20
    python bench/continuous_stack.py --smoke          # CI's check that it still runs: a few tiny jobs, one load
    python bench/continuous_stack.py --jobs 200 --loads 0.5,0.7,0.85 --seed 35

The whole stack (gateway, scheduler, JetStream, PostgreSQL, one sampler, one decoder,
all on this machine) starts twice on the same model: with
``DARKROOM_CONTINUOUS_BATCHING=false`` (batch-at-start), then ``true`` (continuous).

Capacity is measured on the first: per step count of the mix, ``max_batch`` jobs
submitted at once and run as full batches; capacity is the jobs of those batches over
their time, as if full batches of the mix ran back to back (the simulator's capacity).
At each load, a Poisson stream at that fraction of capacity submits ``--jobs`` jobs of
one image each, their steps and seeds drawn from ``--seed``: the same seed draws the
same jobs, at the same arrival times in units of the mean gap, for every load and both
ways (``--capacity`` fixes the rate too, and skips the measure).

Per load and way it prints: jobs per second done (over the first submit to the last
image stored), image p50 and p99 (each job's own record: created to finished), the
share of jobs that joined a running batch (``joined_batch_images > 0``) and the mean
images beside a job over its steps (``batch_images``). Then the ratios the issue's
targets are stated in. On a CPU a batch's members each make their own network call
(``gpu_worker/denoising/step_groups.py``: only alone is a CPU member's output exactly its solo
one), so a batch gains little throughput there; what continuous batching changes on a
CPU is who waits. Nothing here is a test; it prints tables for docs/benchmarks.md."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.support.stack_run import BenchStack
from scheduler.simulator.report import percentile
from services.models.registry import ModelRegistry
from services.models.sources import resolve_source


@dataclass(frozen=True)
class Profile:
    model: str
    size: int
    steps: tuple[int, ...]  # the mix, drawn uniformly
    jobs: int  # per load and way
    loads: tuple[float, ...]


# Sized to fit a GPU session's 10-minute command: about 4 jobs/s of full batches on an H200.
GPU = Profile("sd15-random", 512, (20, 30, 50), 100, (0.5, 0.7, 0.85))
# Step counts far enough apart that a short job arrives while a long batch runs.
CPU = Profile("tiny", 96, (8, 12, 20), 120, (0.5, 0.7, 0.85))
SMOKE = Profile("tiny", 64, (2, 3, 4), 6, (0.7,))
MODES = {"batch-at-start": "false", "continuous": "true"}  # DARKROOM_CONTINUOUS_BATCHING
PROMPTS = ("a lighthouse on a cliff at dusk", "a red fox in fresh snow", "a tram in the rain", "a bowl of figs")
TERMINAL_WAIT_S = 3600.0


@dataclass(frozen=True)
class Arrival:
    gap_units: float  # after the previous arrival, in mean gaps (a unit-rate Poisson stream)
    steps: int
    seed: int
    prompt: str


def schedule(seed: int, jobs: int, steps: Sequence[int]) -> list[Arrival]:
    """The stream's jobs, drawn from ``seed`` alone: the rate only scales the gaps, so
    every load and both ways see the same jobs in the same order."""
    rng = random.Random(seed)
    return [
        Arrival(rng.expovariate(1.0), rng.choice(steps), rng.randrange(2**31), rng.choice(PROMPTS)) for _ in range(jobs)
    ]


@dataclass(frozen=True)
class Run:
    """One stream's (or one capacity round's) jobs, as their records tell it."""

    jobs: list[Any]
    offered_per_s: float = 0.0

    @property
    def wall_s(self) -> float:
        created = min(j.timings.created_time.ToDatetime() for j in self.jobs)
        finished = max(j.timings.finished_time.ToDatetime() for j in self.jobs)
        return (finished - created).total_seconds()

    @property
    def jobs_per_s(self) -> float:
        return len(self.jobs) / self.wall_s

    def latencies(self) -> list[float]:
        return [
            (j.timings.finished_time.ToDatetime() - j.timings.created_time.ToDatetime()).total_seconds()
            for j in self.jobs
        ]

    @property
    def joined(self) -> float:
        return sum(j.joined_batch_images > 0 for j in self.jobs) / len(self.jobs)

    @property
    def mean_batch(self) -> float:
        return sum(j.batch_images for j in self.jobs) / len(self.jobs)


class Stack(BenchStack):
    """The whole stack on this machine, one sampler, batching one way."""

    def __init__(self, root: Path, name: str, models: Path, profile: Profile, device: str, continuous: str) -> None:
        data = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))  # a fresh stack each run, --data-dir or not
        (data / "models").symlink_to(models.resolve(), target_is_directory=True)  # built once, for both
        self.profile = profile
        env = {
            "DARKROOM_DATA_DIR": str(data),
            "DARKROOM_DEVICE": device,
            "DARKROOM_PRELOAD_MODELS": profile.model,
            "DARKROOM_CONTINUOUS_BATCHING": continuous,
        }
        if profile.model not in ModelRegistry.load().models:  # an on-request preset (sd15-random)
            env["DARKROOM_PRESETS"] = profile.model
        super().__init__(env)

    def request(self, steps: int, seed: int, prompt: str) -> Any:
        from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

        size = self.profile.size
        return pb.SubmitJobRequest(
            model=self.profile.model, prompt=prompt, width=size, height=size, steps=steps, seed=seed
        )

    def together(self, steps: int, jobs: int, seed: int) -> Run:
        """``jobs`` jobs of ``steps`` submitted at once, waited for to the end."""
        requests = [self.request(steps, seed + i, PROMPTS[i % len(PROMPTS)]) for i in range(jobs)]
        with ThreadPoolExecutor(min(jobs, 16)) as pool:
            ids = [reply.job_id for reply in pool.map(self.client.SubmitJob, requests)]
        return Run(self.finished(ids))

    def stream(self, arrivals: Sequence[Arrival], per_s: float) -> Run:
        """``arrivals`` submitted at their times at ``per_s`` jobs a second; a pool
        submits, so that a slow submit does not push the ones after it back."""
        started, at = time.monotonic(), 0.0
        with ThreadPoolExecutor(8) as pool:
            replies = []
            for a in arrivals:
                at += a.gap_units / per_s
                time.sleep(max(0.0, started + at - time.monotonic()))
                replies.append(pool.submit(self.client.SubmitJob, self.request(a.steps, a.seed, a.prompt)))
            ids = [r.result().job_id for r in replies]
        return Run(self.finished(ids), per_s)

    def finished(self, ids: Sequence[str]) -> list[Any]:
        """Each job's record once it ended (polled gently: the stack shares this machine's cores)."""
        from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
        from tests.helpers import TERMINAL

        deadline, done = time.monotonic() + TERMINAL_WAIT_S, []
        for job_id in ids:
            while (job := self.client.GetJob(pb.GetJobRequest(job_id=job_id))).status not in TERMINAL:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} still {job.status} after {TERMINAL_WAIT_S:.0f} s")
                time.sleep(0.25)
            done.append(job)
        failed = [j.error for j in done if j.status != pb.JOB_STATUS_SUCCEEDED]
        assert not failed, failed
        return done


def capacity(stack: Stack, max_batch: int) -> tuple[float, list[float]]:
    """Jobs per second of full batches of the mix back to back, and each batch's seconds."""
    stack.together(min(stack.profile.steps), max_batch, 0)  # warm-up: kernels, the decoder, prompt encodings
    walls = [stack.together(steps, max_batch, 1000 * steps).wall_s for steps in stack.profile.steps]
    return max_batch * len(walls) / sum(walls), walls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", help="default: sd15-random at 512 px on a GPU, tiny at 96 px on a CPU")
    parser.add_argument("--size", type=int, help="the images' width and height (default: the model's profile's)")
    parser.add_argument("--steps", help="the step counts of the mix, e.g. 8,12,20 (default: the profile's)")
    parser.add_argument("--jobs", type=int, help="jobs per load and way (default: 100 on a GPU, 120 on a CPU)")
    parser.add_argument("--loads", help="fractions of capacity (default: 0.5,0.7,0.85)")
    parser.add_argument("--seed", type=int, default=35, help="the stream's seed (default 35)")
    parser.add_argument("--capacity", type=float, help="jobs/s of full batches, measured unless given")
    parser.add_argument("--data-dir", default="", help="where models are built and the stacks run (default: temp)")
    parser.add_argument("--smoke", action="store_true", help=f"CI's quick check: {SMOKE}, on the CPU")
    args = parser.parse_args(argv)
    profile = SMOKE if args.smoke else GPU if args.device == "cuda" else CPU
    if args.smoke:
        args.device = "cpu"
    if args.model and args.model != profile.model:
        profile = replace(profile, model=args.model, size=128 if args.device == "cpu" else 512)
    profile = replace(
        profile,
        size=args.size or profile.size,
        steps=tuple(int(s) for s in args.steps.split(",")) if args.steps else profile.steps,
        jobs=args.jobs or profile.jobs,
        loads=tuple(float(x) for x in args.loads.split(",")) if args.loads else profile.loads,
    )
    data = Path(args.data_dir or tempfile.mkdtemp(prefix="darkroom-continuous-"))
    models = data / "models"
    models.mkdir(parents=True, exist_ok=True)
    spec = ModelRegistry.load(presets=None).get(profile.model)
    resolve_source(spec, models)  # built before either stack starts, so no sampler builds it while starting
    what = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# Continuous batching through the stack: {what}; torch {torch.__version__}")
    print(
        f"# {profile.model} at {profile.size} px, steps {'/'.join(map(str, profile.steps))}, one image a job, "
        f"max_batch {spec.max_batch}; {profile.jobs} jobs per load and way; seed {args.seed}"
    )
    arrivals = schedule(args.seed, profile.jobs, profile.steps)
    runs: dict[tuple[float, str], Run] = {}
    per_s = args.capacity
    for mode, continuous in MODES.items():
        with Stack(data, mode, models, profile, args.device, continuous) as stack:
            if per_s is None:
                per_s, walls = capacity(stack, spec.max_batch)
                batches = ", ".join(f"{s} steps {w:.2f} s" for s, w in zip(profile.steps, walls, strict=True))
                print(f"# capacity {per_s:.3f} jobs/s: full batches of {spec.max_batch} ({batches})", flush=True)
            else:
                stack.together(min(profile.steps), spec.max_batch, 0)  # the same warm-up
            for load in profile.loads:
                run = runs[(load, mode)] = stack.stream(arrivals, load * per_s)
                lat = run.latencies()  # as it goes: a run cut off at its cap still leaves these
                print(
                    f"# {load:.0%} {mode}: {len(lat)} jobs in {run.wall_s:.0f} s, {run.jobs_per_s:.3f} jobs/s, "
                    f"p50 {percentile(lat, 50):.2f} s, p99 {percentile(lat, 99):.2f} s, joined {run.joined:.0%}",
                    file=sys.stderr,
                    flush=True,
                )
    report(profile, runs)
    return 0


def report(profile: Profile, runs: dict[tuple[float, str], Run]) -> None:
    print("\n## Poisson load through the stack, one sampler: batch-at-start against continuous\n")
    print("| load | mode | offered jobs/s | jobs/s | image p50 s | image p99 s | joined a running batch | mean batch |")
    print("|---|---|---|---|---|---|---|---|")
    for load in profile.loads:
        for mode in MODES:
            r = runs[(load, mode)]
            lat = r.latencies()
            print(
                f"| {load:.0%} | {mode} | {r.offered_per_s:.3f} | {r.jobs_per_s:.3f} | {percentile(lat, 50):.2f} | "
                f"{percentile(lat, 99):.2f} | {r.joined:.0%} | {r.mean_batch:.2f} |"
            )
    print("\n| load | p50 at-start / continuous | p99 at-start / continuous | jobs/s continuous / at-start |")
    print("|---|---|---|---|")
    for load in profile.loads:
        a, c = runs[(load, "batch-at-start")], runs[(load, "continuous")]
        la, lc = a.latencies(), c.latencies()
        print(
            f"| {load:.0%} | {percentile(la, 50) / percentile(lc, 50):.2f} | "
            f"{percentile(la, 99) / percentile(lc, 99):.2f} | {c.jobs_per_s / a.jobs_per_s:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
