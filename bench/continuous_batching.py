"""Continuous batching at step boundaries against batch-at-start (issue 35), under
Poisson load: in the step-level simulator with a central queue
(``scheduler/simulator/stepping.py``), then through Darkroom's placement (the
production driver, ``DarkroomPolicy``, in the event engine with
``continuous=True``: a job goes where the policy places it, joining a running
batch only where placement sent it to that batch's open seat).

    python bench/continuous_batching.py [--scenario FILE] [--seeds N] [--loads A,B] [--duration-s S] [--gpus N]
                                        [--processes N]
    python bench/continuous_batching.py --smoke    # CI's check that it still runs: one seed, a 60 s trace

The scenario (``scheduler/simulator/continuous_scenario.toml`` unless given: four
H200s, SD 1.5 at 512 px timed by the batch-size curve measured on an H200, a mix of
step counts; ``--gpus N``: N of its first GPU instead) runs at each of its loads,
over ``N`` trace seeds (the scenario's and the next ones), each trace both ways
and under both placements. A load is a fraction of capacity, and
capacity is every GPU running full batches (``max_batch`` images), the most the
fleet can do; the trace's Poisson rate is that fraction of it.

It prints per placement, load and way: images per second done (over the time until the last
is done), image p50 and p99 latency (arrival to image done), the GPUs' busy time
as a fraction of the run, and the share of jobs that joined a running batch; each
the median over the seeds with the worst seed in brackets. Then, per load, the
ratios the issue's targets are stated in, taken per seed: p50 and p99 of
batch-at-start over continuous (at 50 % and 70 %: p50 at least 1.5, p99 at least
1), and continuous images per second over batch-at-start's (at 85 %: at least 1).

The same scenario and seeds print the same output whatever the hash seed or the
number of processes; wall time goes to standard error.
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.simulator import scenario as scenarios
from scheduler.simulator import stepping
from scheduler.simulator import trace as traces
from scheduler.simulator.engine import Simulation
from scheduler.simulator.policies import DarkroomPolicy
from scheduler.simulator.report import median, percentile, spread, worst
from scheduler.simulator.stepping import Mode

CONTINUOUS_SCENARIO = scenarios.DEFAULT_SCENARIO.with_name("continuous_scenario.toml")
SMOKE = {"seeds": 1, "duration_s": 60.0, "processes": 1}
# The targets: load -> (least p50 ratio, least p99 ratio, least throughput ratio).
TARGETS = {0.5: (1.5, 1.0, None), 0.7: (1.5, 1.0, None), 0.85: (None, None, 1.0)}


class Placement(enum.StrEnum):
    CENTRAL = "a central queue"  # stepping.py: each GPU takes from it as room opens
    DARKROOM = "Darkroom's placement"  # the production driver in the event engine


Key = tuple[Placement, float, int, Mode]  # placement, load, trace seed, way


@dataclass(frozen=True)
class Figures:
    images_per_s: float
    p50_s: float
    p99_s: float
    busy: float  # GPU busy time over GPUs x the run
    joined: float  # share of jobs that joined a running batch
    overloaded: bool = False  # the engine stopped before every job was done

    @classmethod
    def of(
        cls, done: Sequence[tuple[float, int, bool]], span: float, busy_s: float, gpus: int, *, overloaded: bool
    ) -> Figures:
        """From each job done: (latency, images, whether it joined a running batch)."""
        latencies = [latency for latency, _, _ in done]
        span = span or math.nan
        return cls(
            images_per_s=sum(images for _, images, _ in done) / span,
            p50_s=percentile(latencies, 50),
            p99_s=percentile(latencies, 99),
            busy=busy_s / (gpus * span),
            joined=sum(joined for _, _, joined in done) / max(len(done), 1),
            overloaded=overloaded,
        )


def batched_capacity_factor(sc: scenarios.Scenario) -> float:
    """Capacity with full batches over the trace's (one job at a time): the mean
    over the scenario's models, weighted by the work they get, of max_batch over
    the batch factor at max_batch."""
    work: dict[str, float] = {}
    for phase in sc.phases:
        for name, weight in phase.weights.items():
            jt = sc.job_types[name]
            work[jt.model] = work.get(jt.model, 0.0) + weight * sc.work_s(jt)
    # Seconds of batched work per second of one-at-a-time work, inverted.
    batched = 0.0
    for name, w in work.items():
        model = sc.models[name]
        batched += w * model.batch_factor(model.max_batch) / model.max_batch
    return sum(work.values()) / batched


def simulate(sc: scenarios.Scenario, key: Key) -> Figures:
    """One trace (of ``key``'s load and seed) run the ``key``'s way, placed its way."""
    placement, load, seed, mode = key
    jobs = traces.trace(replace(sc, seed=seed), load * batched_capacity_factor(sc))
    gpus = len(sc.gpus)
    if placement is Placement.CENTRAL:
        run = stepping.simulate(sc, jobs, mode)
        done = [(f.latency_s, f.images, f.joined) for f in run.finished]
        return Figures.of(done, run.makespan_s, run.busy_s, gpus, overloaded=False)
    result = Simulation(sc, DarkroomPolicy(sc), jobs, load=load, continuous=mode is Mode.CONTINUOUS).run()
    done = [
        (j.finish_s - j.trace.arrival_s, j.trace.type.batch, j.joined) for j in result.jobs if j.finish_s is not None
    ]
    return Figures.of(done, result.makespan_s, result.busy_s, gpus, overloaded=result.overloaded)


def run_all(sc: scenarios.Scenario, seeds: range, processes: int) -> dict[Key, Figures]:
    keys = [(p, load, seed, mode) for p in Placement for load in sc.loads for seed in seeds for mode in Mode]
    if processes <= 1:
        return {key: simulate(sc, key) for key in keys}
    with ProcessPoolExecutor(max_workers=processes) as pool:
        return dict(zip(keys, pool.map(simulate, [sc] * len(keys), keys), strict=True))


def _ratio_cell(values: list[float], least: float | None) -> str:
    """``median (worst)``, and whether the worst seed meets ``least``."""
    cell = spread(values, ".2f", higher_is_better=True)
    if least is None:
        return cell
    return f"{cell} {'met' if worst(values, higher_is_better=True) >= least else 'NOT met'} (>= {least:g})"


def report(sc: scenarios.Scenario, seeds: range, placement: Placement, figures: dict[Key, Figures]) -> list[str]:
    capacity = sc.capacity_jobs_per_s() * batched_capacity_factor(sc)
    out = [
        f"## {sc.name}, placed by {placement.value}: {len(sc.gpus)} GPUs, capacity {capacity:.2f} jobs/s "
        f"(full batches), {sc.duration_s:.0f} s traces, seeds {seeds.start}..{seeds.stop - 1}",
        "",
        f"Each cell: the median over {len(seeds)} trace seeds, the worst seed in brackets.",
        "",
        "| load | mode | img/s | image p50 s | image p99 s | GPU busy | joined a running batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for load in sc.loads:
        for mode in Mode:
            rows = [figures[(placement, load, s, mode)] for s in seeds]
            cells = [
                f"{load:.0%}",
                mode.value,
                spread([r.images_per_s for r in rows], ".3f", higher_is_better=True),
                spread([r.p50_s for r in rows], ".3f"),
                spread([r.p99_s for r in rows], ".3f"),
                f"{median([r.busy for r in rows]):.1%}",
                f"{median([r.joined for r in rows]):.0%}",
            ]
            out.append("| " + " | ".join(cells) + " |")
    overloaded = [
        f"{k[1]:.0%} seed {k[2]} {k[3].value}" for k, f in figures.items() if k[0] is placement and f.overloaded
    ]
    if overloaded:
        out += ["", f"Overloaded (stopped before every job was done): {', '.join(overloaded)}."]
    out += [
        "",
        "Per seed, then median (worst); a target is met when its worst seed meets it.",
        "",
        "| load | p50 at-start / continuous | p99 at-start / continuous | img/s continuous / at-start |",
        "|---|---|---|---|",
    ]
    for load in sc.loads:
        pairs = [
            (figures[(placement, load, s, Mode.AT_START)], figures[(placement, load, s, Mode.CONTINUOUS)])
            for s in seeds
        ]
        least = TARGETS.get(load, (None, None, None))
        cells = [
            _ratio_cell([a.p50_s / c.p50_s for a, c in pairs], least[0]),
            _ratio_cell([a.p99_s / c.p99_s for a, c in pairs], least[1]),
            _ratio_cell([c.images_per_s / a.images_per_s for a, c in pairs], least[2]),
        ]
        out.append(f"| {load:.0%} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default=str(CONTINUOUS_SCENARIO))
    parser.add_argument("--seeds", type=int, default=5, help="trace seeds (default 5)")
    parser.add_argument("--loads", help="comma-separated fractions of capacity (default: the scenario's)")
    parser.add_argument("--duration-s", type=float, help="trace length (default: the scenario's)")
    parser.add_argument("--gpus", type=int, help="this many of the scenario's first GPU (default: its fleet)")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if args.seeds < 1 or (args.gpus is not None and args.gpus < 1):
        print("error: --seeds and --gpus must be at least 1", file=sys.stderr)
        return 2
    try:
        sc = scenarios.load(args.scenario)
        if args.loads:
            sc = replace(sc, loads=tuple(float(x) for x in args.loads.split(",")))
    except (scenarios.ScenarioError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.duration_s:
        sc = replace(sc, duration_s=args.duration_s)
    if args.gpus:
        first = sc.gpus[0]
        gpus = tuple(replace(first, id=f"{first.id}-{i}") for i in range(args.gpus))
        sc = replace(sc, name=f"{sc.name}, as {args.gpus} x {first.id}", gpus=gpus)
    seeds = range(sc.seed, sc.seed + args.seeds)
    started = time.monotonic()
    figures = run_all(sc, seeds, args.processes)
    print("\n\n".join("\n".join(report(sc, seeds, p, figures)) for p in Placement))
    print(f"({len(figures)} simulations in {time.monotonic() - started:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
