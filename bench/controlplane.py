"""The control plane measured: how many jobs per second the whole stack carries, and
how much time it adds to each job, with a model that costs only its modelled time.

    python bench/controlplane.py [--samplers 2] [--decoders 1] [--seconds 8] [--profile]
    python bench/controlplane.py --smoke    # CI's check that it still runs: one sampler, two rates, a second each

Every job goes the whole way: gateway, PostgreSQL, scheduler, JetStream, a sampler
process, the decoder service, a stored result, back to the client. The samplers run
the ``sim`` model of ``bench/sim_registry.toml`` (services/models/sim.py): 10 ms
per step at 64 px, so the GPUs' own time is known exactly and far from the limit.
The stack is ``darkroom up``'s: real processes, a durable PostgreSQL, nats-server
with file storage. Load comes from ``bench/support/loadgen.py`` in its own process: jobs
arrive open-loop (Poisson, from the seed) whether or not earlier ones finished.

It prints, in order:
1. the floor: the same sim work (sleep, latents, decode, PNG) in a plain loop;
2. throughput at rising rates until completions fall behind arrivals, with each
   process's CPU time per job, and (--profile) each service's hottest functions;
3. added latency (submit to last image byte, minus the modelled sampling time) at
   light load and at 80 % of saturation, through StreamJob and by polling GetJob,
   with the median of each stage from the jobs' own timings.
Nothing here is a test; the tables go into docs/benchmarks.md."""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from bench.support import loadgen, service_costs
from bench.support.service_costs import cpu_seconds, processes
from services.config.sections import Settings
from services.models import sim
from services.models.registry import ModelRegistry
from services.ops.stack import LocalStack
from services.telemetry.stages import STAGES

HERE = Path(__file__).resolve().parent
REGISTRY = HERE / "sim_registry.toml"
MODEL = "sim"
SIZE = 64
STEPS = 1
# A level whose completions fall below this share of its arrivals is past saturation.
KEEPS_UP = 0.9
SMOKE = {
    "samplers": 1,
    "seconds": 1.0,
    "rates": "10,20",
    "light_rate": 5.0,
    "light_seconds": 1.0,
    "floor_jobs": 20,
    "warmup_seconds": 1.0,
}


def modelled_s() -> float:
    spec = ModelRegistry.load(REGISTRY).get(MODEL)
    return sim.step_seconds(spec, SIZE, SIZE) * STEPS


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


# -- the floor ---------------------------------------------------------------------


def floor(jobs: int) -> list[float]:
    """Seconds per job of the same sim work with no services: the sampler's sleep and
    latents, the decoder's projection and checks, the PNG."""
    import threading

    import torch

    from services.models.encoding import encode
    from services.models.vae import VaeDecoderEngine

    torch.set_num_threads(1)
    registry = ModelRegistry.load(REGISTRY)
    spec = registry.get(MODEL)
    decoder = VaeDecoderEngine(registry, Path(tempfile.gettempdir()), torch.device("cpu"))

    @dataclass(frozen=True)
    class Job:
        width: int
        height: int
        seed: int
        num_images: int = 1

    times = []
    for i in range(jobs):
        started = time.perf_counter()
        sim.sleep_steps(spec, SIZE, SIZE, STEPS, [threading.Event()], lambda *_: None)
        latents = sim.latents(Job(SIZE, SIZE, i))
        [image] = decoder.decode_images(MODEL, latents)
        encode(image.pixels, "image/png")
        times.append(time.perf_counter() - started)
    return times


# -- the stack and its processes ------------------------------------------------------


def start_stack(data_dir: Path, samplers: int, decoders: int, *, image_filter: bool = True) -> LocalStack:
    settings = Settings.from_env(
        {
            "DARKROOM_DATA_DIR": str(data_dir),
            "DARKROOM_GATEWAY_PORT": "0",
            "DARKROOM_MODEL_REGISTRY": str(REGISTRY),
            "DARKROOM_PRELOAD_MODELS": MODEL,
            "DARKROOM_LOG_LEVEL": "INFO",
            "DARKROOM_IMAGE_FILTER": str(image_filter).lower(),
        }
    )
    stack = LocalStack(settings, cpu_workers=samplers, decoders=decoders, durable=True)
    stack.start(timeout=180)
    return stack


# -- one run of load -----------------------------------------------------------------


@dataclass
class Run:
    rate: float
    mode: str
    records: list[dict[str, Any]]
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per service during the run
    wall_s: float = 0.0
    profiles: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    # Per service: CPU ms, statements and messages per completed job (service_costs).
    costs: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def done(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["status"] == "SUCCEEDED"]

    @property
    def achieved(self) -> float:
        """Completed jobs per second: from the first submit to the last completion."""
        done = self.done
        if len(done) < 2:
            return 0.0
        span = max(r["finished_s"] for r in done) - min(r["sent_s"] for r in self.records)
        return len(done) / span

    @property
    def lag_p99_ms(self) -> float:
        """How late the generator sent its submits (it shares the cores)."""
        return percentile([r["sent_s"] - r["due_s"] for r in self.records], 99) * 1000


def run_load(stack: LocalStack, rate: float, seconds: float, mode: str, seed: int, label: str, profile: bool) -> Run:
    with tempfile.TemporaryDirectory() as tmp:
        config = loadgen.Config(
            address=stack.gateway_address,
            rate=rate,
            seconds=seconds,
            seed=seed,
            mode=mode,
            model=MODEL,
            size=SIZE,
            steps=STEPS,
            label=label,
        )
        config_path, result_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        config_path.write_text(json.dumps(config.__dict__))
        groups = processes(stack)
        costs_before = service_costs.read(stack)
        before = cpu_seconds(groups)
        generator = subprocess.Popen([sys.executable, loadgen.__file__, str(config_path), str(result_path)])
        groups["loadgen"] = [psutil.Process(generator.pid)]
        spies = start_profiles(groups, seconds, Path(tmp)) if profile else {}
        started = time.perf_counter()
        generator_cpu = 0.0
        while generator.poll() is None:
            try:
                t = groups["loadgen"][0].cpu_times()
                generator_cpu = t.user + t.system
            except psutil.Error:
                pass
            time.sleep(0.1)
        wall = time.perf_counter() - started
        after = cpu_seconds(groups)
        costs_after = service_costs.read(stack)
        after["loadgen"] = generator_cpu
        before["loadgen"] = 0.0
        if generator.returncode != 0:
            raise RuntimeError(f"the load generator failed with {generator.returncode}")
        result = json.loads(result_path.read_text())
        run = Run(rate, mode, result["records"], {k: after[k] - before.get(k, 0.0) for k in after}, wall)
        run.profiles = finish_profiles(spies)
        run.costs = service_costs.per_job(costs_before, costs_after, len(run.done))
        return run


# -- profiles ------------------------------------------------------------------------


def start_profiles(groups: dict[str, list[psutil.Process]], seconds: float, tmp: Path) -> dict[str, Any]:
    """py-spy on the first process of each Python service, for the run's duration."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        print("(no py-spy in this environment: pip install py-spy for profiles)", file=sys.stderr)
        return {}
    spies = {}
    for name in ("gateway", "scheduler", "sampler", "decoder", "loadgen"):
        if not groups.get(name):
            continue
        out = tmp / f"{name}.txt"
        cmd = [str(spy), "record", "--pid", str(groups[name][0].pid), "--duration", str(int(seconds)), "--rate", "200"]
        # Only samples holding the GIL: Python at work, not a loop waiting for I/O.
        cmd += ["--format", "raw", "--nonblocking", "--gil", "--output", str(out)]
        spies[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
    return spies


def finish_profiles(spies: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Per service, where its samples went: each sample is charged to the innermost
    of Darkroom's own functions on its stack (what it spent, libraries included),
    or to the library function it was in when no Darkroom frame is on the stack."""
    profiles = {}
    for name, (proc, out) in spies.items():
        proc.wait(timeout=120)
        counts: collections.Counter[str] = collections.Counter()
        total = 0
        if out.exists():
            for line in out.read_text().splitlines():
                stack, _, n = line.rpartition(" ")
                if not stack or not n.isdigit():
                    continue
                frames = stack.split(";")
                own = [f for f in frames if _ours(f)]
                counts[_short(own[-1] if own else frames[-1])] += int(n)
                total += int(n)
        profiles[name] = [(frame, n / total) for frame, n in counts.most_common(10)] if total else []
    return profiles


ROOT = str(HERE.parent) + "/"
PACKAGES = ("gateway/", "scheduler/", "gpu_worker/", "vae_worker/", "services/")


def _ours(frame: str) -> bool:
    # py-spy names a module by its path, relative to the process's directory when it can.
    where = frame.partition(" (")[2].removeprefix(ROOT)
    return where.startswith(PACKAGES)


def _short(frame: str) -> str:
    # "function (path/to/module.py:123)" -> "function (module.py)"
    name, _, where = frame.partition(" (")
    module = where.rstrip(")").rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({module})" if module else name


# -- stage timings ---------------------------------------------------------------------


def stage_medians(run: Run) -> dict[str, float]:
    """The median of each stage over the run's jobs, from their own timings (ms)."""
    return {
        stage: statistics.median(values) * 1000
        if (values := [r["stages"][stage] for r in run.done if stage in r["stages"]])
        else float("nan")
        for stage in STAGES
    }


# -- report --------------------------------------------------------------------------


def fmt(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def throughput_table(runs: list[Run], floor_rate: float) -> str:
    """``floor_rate``: jobs/s the same sim work does in plain loops, one per sampler."""
    services = ["gateway", "scheduler", "sampler", "decoder", "postgres", "nats-server", "loadgen"]
    head = "| offered jobs/s | completed jobs/s | vs floor | e2e p50 ms | e2e p99 ms | failed | generator lag p99 ms | "
    head += " | ".join(f"{s} CPU ms/job" for s in services) + " | CPU use |"
    lines = [head, "|" + "---|" * (8 + len(services))]
    for run in runs:
        done = run.done
        n = max(len(done), 1)
        e2e = [r["end_to_end_s"] * 1000 for r in done]
        cpu = [fmt(run.cpu.get(s, 0.0) / n * 1000, 2) for s in services]
        use = sum(run.cpu.values()) / max(run.wall_s, 1e-9)
        lines.append(
            f"| {run.rate:.0f} | {run.achieved:.0f} | {run.achieved / floor_rate:.2f} | {fmt(percentile(e2e, 50))} | "
            f"{fmt(percentile(e2e, 99))} | {len(run.records) - len(done)} | {fmt(run.lag_p99_ms)} | "
            + " | ".join(cpu)
            + f" | {use:.2f} cores |"
        )
    return "\n".join(lines)


def latency_rows(label: str, run: Run, modelled: float, floor_s: float, stages: dict[str, float]) -> str:
    """``floor_s``: one job of the same sim work in a plain loop."""
    added = [(r["end_to_end_s"] - modelled) * 1000 for r in run.done]
    e2e_p50 = percentile([r["end_to_end_s"] for r in run.done], 50)
    cells = [fmt(percentile(added, q)) for q in (50, 95, 99)]
    return (
        f"| {label} | {run.mode} | {run.rate:.0f} | {len(run.done)}/{len(run.records)} | "
        + " | ".join(cells)
        + f" | {e2e_p50 / floor_s:.1f}x | "
        + " | ".join(fmt(stages[s]) for s in STAGES)
        + " |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samplers", type=int, default=2, help="sim sampler processes")
    parser.add_argument("--decoders", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each load level lasts")
    parser.add_argument("--rates", default="25,50,100,200,300,400,600,800,1000,1200", help="offered jobs/s, rising")
    parser.add_argument("--light-rate", type=float, default=10.0, help="jobs/s of the light-load latency runs")
    parser.add_argument("--light-seconds", type=float, default=30.0)
    parser.add_argument("--floor-jobs", type=int, default=200, help="jobs of the plain-loop floor")
    parser.add_argument("--warmup-seconds", type=float, default=3.0, help="load at 20 jobs/s before the first level")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="py-spy each service at the saturating level")
    parser.add_argument(
        "--no-image-filter",
        action="store_true",
        help="the control plane alone: no output scored (a GPU decoder scores on its GPU, not its host's cores)",
    )
    parser.add_argument("--data-dir", help="where the stack keeps its data (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)

    modelled = modelled_s()
    print(f"# Control plane: sim model, {SIZE}x{SIZE}, {STEPS} step, modelled sampling {modelled * 1000:.1f} ms")
    scored = "no output scored" if args.no_image_filter else "every output scored by the image filter"
    print(f"# {args.samplers} sim samplers, {args.decoders} decoder(s), {os.cpu_count()} cores, {scored}\n")

    floors = floor(args.floor_jobs)
    floor_s = statistics.median(floors)
    print("## Floor: the same sim work in a plain loop, no services\n")
    print("| per job p50 ms | per job p99 ms | overhead over modelled p50 ms | jobs/s per sampler | jobs/s, all |")
    print("|---|---|---|---|---|")
    print(
        f"| {floor_s * 1000:.2f} | {percentile(floors, 99) * 1000:.2f} | {(floor_s - modelled) * 1000:.2f} | "
        f"{1 / floor_s:.0f} | {args.samplers / floor_s:.0f} |\n"
    )

    data_dir = Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="darkroom-bench-"))
    stack = start_stack(data_dir, args.samplers, args.decoders, image_filter=not args.no_image_filter)
    runs: list[Run] = []
    latency_runs: list[Run] = []
    try:
        run_load(stack, 20, args.warmup_seconds, "stream", args.seed + 999, "warmup", profile=False)
        saturating: Run | None = None
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            run = run_load(stack, rate, args.seconds, "stream", args.seed + i, f"rate{rate:.0f}", profile=False)
            runs.append(run)
            print(f"  offered {rate:.0f}/s: completed {run.achieved:.0f}/s", file=sys.stderr)
            if run.achieved < KEEPS_UP * rate or len(run.done) < len(run.records):
                saturating = run
                break
        best = max(runs, key=lambda r: r.achieved)
        saturation = best.achieved
        if args.profile:
            rerun = saturating or best
            profiled = run_load(stack, rerun.rate, args.seconds, "stream", args.seed + 500, "profile", profile=True)
        print("## Throughput (StreamJob clients, open loop)\n")
        print(throughput_table(runs, args.samplers / floor_s))
        print(f"\nsaturation: {saturation:.0f} jobs/s completed end to end\n")
        print("## What a job costs each service, per offered rate\n")
        print("| offered jobs/s " + service_costs.HEADER)
        print("|---" + "|---|---|---|---|---|")
        for run in runs:
            print("\n".join(service_costs.table_rows(run.costs, prefix=f"{run.rate:.0f} | ")))
        print()
        if args.profile:
            print(f"## Where the time goes at {profiled.rate:.0f} jobs/s offered (py-spy, share of samples)\n")
            for name, frames in profiled.profiles.items():
                print(f"- **{name}**: " + "; ".join(f"{frame} {share:.0%}" for frame, share in frames[:6]))
            print()

        print("## Added latency: submit to last image byte minus the modelled sampling time (ms)\n")
        print(
            "| load | client | jobs/s | completed | p50 | p95 | p99 | e2e p50 vs floor | " + " | ".join(STAGES) + " |"
        )
        print("|" + "---|" * (8 + len(STAGES)))
        busy = max(saturation * 0.8, 1.0)
        for label, rate, seconds in (
            ("light", args.light_rate, args.light_seconds),
            ("80 %", busy, args.seconds),
        ):
            for mode in ("stream", "poll"):
                run = run_load(stack, rate, seconds, mode, args.seed + 100, f"{label}-{mode}", profile=False)
                latency_runs.append(run)
                stages = stage_medians(run)
                print(latency_rows(label, run, modelled, floor_s, stages))
        print("\nstage columns: medians in ms of queue (created to placed), schedule (placed to published),")
        print("dispatch (published to started), sample, decode, store (decoded to stored)")
    finally:
        stack.stop()
    # Tables of a stack that completes nothing still print: say so, and fail.
    for run in [*runs, *latency_runs]:
        if run.records and not run.done:
            errors = sorted({r["error"] or r["status"] for r in run.records})
            print(f"error: no job completed at {run.rate:.0f} jobs/s ({run.mode}): {errors[:3]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
