"""Fair-share benchmark: one heavy tenant (20 times the rate of each of eight light
tenants, in bursts) beside light ones in one lane, in the discrete-event
simulator, through Darkroom's production policy.

    python bench/fairness.py [--scenario FILE] [--seeds N] [--processes N] [--loads A,B] [--duration-s S]
    python bench/fairness.py --smoke    # CI's check that it still runs: one seed, one load, a 600 s trace

For each load level of the scenario (``scheduler/simulator/fairness_scenario.toml``
unless given) and each of ``N`` trace seeds (the scenario's and the next ones) it
runs the trace three ways: fair sharing on, off, and the light tenants alone (the
same trace without the heavy tenant's jobs). It prints per run the light tenants'
image p99, the heavy tenant's jobs/s and GPU utilisation; then, per load, the
median and worst over the seeds of: light p99 with the heavy tenant over light p99
alone (target at most 1.25), the same with fair sharing off, and the heavy
tenant's throughput and the utilisation with fair sharing on over off (1.0: fair
sharing costs nothing; it only reorders).

The same scenario and seeds print the same output whatever the hash seed or the
number of processes; wall time goes to standard error.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.simulator import scenario as scenarios
from scheduler.simulator.fairness import FairRow, Run, fair_run
from scheduler.simulator.report import median, worst

FAIRNESS_SCENARIO = scenarios.DEFAULT_SCENARIO.with_name("fairness_scenario.toml")

Key = tuple[float, int, Run]  # load, trace seed, run
# Two of the scenario's five-minute burst cycles, one load: seconds on a CPU.
SMOKE = {"seeds": 1, "processes": 1, "loads": "0.85", "duration_s": 600.0}


def _scenario(path: str, duration_s: float | None) -> scenarios.Scenario:
    sc = scenarios.load(path)
    return replace(sc, duration_s=duration_s) if duration_s else sc


def _run(path: str, duration_s: float | None, key: Key) -> FairRow:
    load, seed, run = key
    return fair_run(replace(_scenario(path, duration_s), seed=seed), load, run)


def _ratios(rows: dict[Key, FairRow], load: float, seeds: range, a: Run, b: Run, figure: str) -> list[float]:
    """Per seed, ``figure`` of run ``a`` over that of run ``b``."""
    pairs = [(getattr(rows[(load, s, a)], figure), getattr(rows[(load, s, b)], figure)) for s in seeds]
    return [x / y if y else float("nan") for x, y in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default=str(FAIRNESS_SCENARIO))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--loads", help="comma-separated load levels (default: the scenario's)")
    parser.add_argument("--duration-s", type=float, help="the trace's length (default: the scenario's)")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    sc = _scenario(args.scenario, args.duration_s)
    if args.loads:
        sc = replace(sc, loads=tuple(float(x) for x in args.loads.split(",")))
    seeds = range(sc.seed, sc.seed + args.seeds)
    keys: list[Key] = [(load, seed, run) for load in sc.loads for seed in seeds for run in Run]
    started = time.monotonic()
    if args.processes > 1:
        with ProcessPoolExecutor(args.processes) as pool:
            paths, durations = [args.scenario] * len(keys), [args.duration_s] * len(keys)
            rows = dict(zip(keys, pool.map(_run, paths, durations, keys), strict=True))
    else:
        rows = {key: _run(args.scenario, args.duration_s, key) for key in keys}
    print(f"# Fair shares: {sc.name} ({Path(args.scenario).name}), {sc.tenants.light} light tenants and one heavy")
    print(f"# {len(sc.gpus)} GPUs, {sc.duration_s:g}s trace, trace seeds {seeds[0]}..{seeds[-1]}")
    print()
    print("| load | seed | run | light p99 s | heavy jobs/s | GPU util | overloaded |")
    print("|---|---|---|---|---|---|---|")
    for (load, seed, run), row in rows.items():
        print(
            f"| {load:g} | {seed} | {run} | {row.light_p99_s:.2f} | {row.heavy_jobs_per_s:.3f} | "
            f"{row.utilisation:.3f} | {'yes' if row.overloaded else 'no'} |"
        )
    print()
    print(
        "| load | light p99 with heavy / alone, fair | same, unfair | heavy jobs/s fair / unfair | util fair / unfair |"
    )
    print("|---|---|---|---|---|")
    for load in sc.loads:
        fair = _ratios(rows, load, seeds, Run.FAIR, Run.ALONE, "light_p99_s")
        unfair = _ratios(rows, load, seeds, Run.UNFAIR, Run.ALONE, "light_p99_s")
        heavy = _ratios(rows, load, seeds, Run.FAIR, Run.UNFAIR, "heavy_jobs_per_s")
        util = _ratios(rows, load, seeds, Run.FAIR, Run.UNFAIR, "utilisation")
        print(
            f"| {load:g} | {median(fair):.2f} (worst {worst(fair):.2f}) | {median(unfair):.2f} "
            f"(worst {worst(unfair):.2f}) | {median(heavy):.3f} (worst {worst(heavy, higher_is_better=True):.3f}) | "
            f"{median(util):.3f} (worst {worst(util, higher_is_better=True):.3f}) |"
        )
    print(f"wall {time.monotonic() - started:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
