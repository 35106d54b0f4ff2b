"""Placement benchmark: Darkroom's production policy against the seeds' policies,
and against the ideal (every model warm on every GPU it fits, nothing to load:
the physical limit of the fleet for a work-conserving policy), in the
discrete-event simulator, on the fleets and traces of scenario files.

    python bench/placement.py [--scenario FILE ...] [--seeds N] [--policies a,b] [--processes N]

Every scenario (default: those shipped, the default one last) runs over ``N``
trace seeds (the scenario's seed and the next ones). Per scenario it prints, per
policy and load level, throughput, image p50/p95/p99, best-effort p99 and
throughput (jobs with no latency target), cold loads and GPU utilisation, each
the median over the seeds with the worst seed in brackets; each policy's
sustainable load (the highest scanned load before image p99 first passes the
scenario's limit); and the verdict figures, each taken per seed, then median and
worst. Then a line per scenario and, last, the two figures the targets are
stated in, for the default scenario (or the last one given).

A quick run of some policies only:

    python bench/placement.py --scenario scheduler/simulator/default_scenario.toml \\
        --seeds 2 --policies darkroom,ideal

CI's check that it still runs, in seconds: the living room's scenario alone (two
GPUs), one seed, every policy at 85 % (``--loads`` stands for the scenario's loads
and scan):

    python bench/placement.py --smoke

The same scenarios and seeds print the same standard output whatever the hash
seed or the number of processes; wall time goes to standard error.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.simulator import scenario as scenarios
from scheduler.simulator import trace as traces
from scheduler.simulator.engine import Simulation
from scheduler.simulator.fleet import Policy
from scheduler.simulator.ideal import NAME as IDEAL
from scheduler.simulator.ideal import IdealPolicy, ideal_scenario
from scheduler.simulator.policies import POLICIES, SEEDS
from scheduler.simulator.report import Row, median, seed_table, summarize, sustainable, worst

SIMULATOR = scenarios.DEFAULT_SCENARIO.parent
# The scenarios a plain run benches, the default one last (its figures end the output).
SHIPPED = (
    "video_heavy_scenario.toml",
    "living_room_scenario.toml",
    "rack_scenario.toml",
    "default_scenario.toml",
)
ORDER = ("darkroom", *SEEDS, IDEAL)
# Policies run only when asked for (--policies): Darkroom with a part of its
# knowledge taken away, for the scenario that weighs that part.
ON_REQUEST = ("darkroom-adapter-blind",)
# 85 % is the level the verdict figures are read at.
SMOKE = {"seeds": 1, "processes": 1, "loads": "0.85"}
# The smoke's scenario: the smallest shipped fleet (two GPUs), about half the default's CPU.
SMOKE_SCENARIO = SIMULATOR / "living_room_scenario.toml"


@functools.lru_cache(maxsize=64)
def _scenario(path: str, seed: int) -> scenarios.Scenario:
    return replace(scenarios.load(path), seed=seed)


def simulate(path: str, policy: str, seed: int, load: float) -> Row:
    """One run: ``policy`` on the scenario at ``path`` with trace seed ``seed``."""
    sc = _scenario(path, seed)
    trace = traces.trace(sc, load)
    world, chosen = sc, None
    if policy == IDEAL:
        world = ideal_scenario(sc)
        chosen = IdealPolicy(world)
    placement: Policy = chosen if chosen is not None else POLICIES[policy](sc)
    return summarize(Simulation(world, placement, trace, load=load).run())


Key = tuple[int, str, int, float]  # scenario index, policy, trace seed, load


@dataclass
class _Scan:
    """One (scenario, policy, seed): its levels in order, how far the scan has
    passed, and whether it stopped at a failing level."""

    scenario: int
    policy: str
    seed: int
    levels: list[float]
    limit_s: float
    at: int = 0
    stopped: bool = False

    def key(self, level: float) -> Key:
        return (self.scenario, self.policy, self.seed, level)


class _Inline:
    """An executor that runs each call as it is submitted (one process)."""

    def submit(self, fn: Callable[..., Row], /, *args: Any) -> Future[Row]:
        future: Future[Row] = Future()
        future.set_result(fn(*args))
        return future

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def run_all(
    paths: Sequence[str], loaded: Sequence[scenarios.Scenario], policies: Sequence[str], seeds: int, processes: int
) -> dict[Key, Row]:
    """Every (scenario, policy, seed) at its table's loads, and up its scan until
    image p99 first fails. Each scan goes on from its own results alone, so what
    is run, and so every figure, is the same whatever order runs finish in."""
    rows: dict[Key, Row] = {}
    scans = [
        _Scan(i, p, sc.seed + s, sorted(set(sc.loads) | set(sc.scan)), sc.p99_limit_s)
        for p in policies  # Darkroom's runs, the longest, first
        for i, sc in enumerate(loaded)
        for s in range(seeds)
    ]
    pending: dict[Future[Row], Key] = {}
    submitted: set[Key] = set()
    pool: ProcessPoolExecutor | _Inline = ProcessPoolExecutor(max_workers=processes) if processes > 1 else _Inline()

    def submit(key: Key) -> None:
        if key not in submitted:
            submitted.add(key)
            pending[pool.submit(simulate, paths[key[0]], key[1], key[2], key[3])] = key

    def advance(scan: _Scan) -> None:
        while not scan.stopped and scan.at < len(scan.levels):
            row = rows.get(scan.key(scan.levels[scan.at]))
            if row is None:
                submit(scan.key(scan.levels[scan.at]))
                return
            if not row.p99("image") < scan.limit_s:
                scan.stopped = True
                return
            scan.at += 1

    with pool:
        for scan in scans:
            for level in loaded[scan.scenario].loads:
                submit(scan.key(level))
            advance(scan)
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f]):
                rows[pending.pop(future)] = future.result()
            for scan in scans:
                advance(scan)
    return rows


def ratio(a: float, b: float) -> float:
    """``a / b``, with two overloads (or two zeros) as 1 and one as 0 or infinity."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if math.isinf(b):
        return 1.0 if math.isinf(a) else 0.0
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def _fig(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def _pair(values: list[float], *, higher_is_better: bool = False) -> tuple[float, float]:
    return median(values), worst(values, higher_is_better=higher_is_better)


@dataclass(frozen=True)
class Verdict:
    name: str
    held: tuple[float, float]  # Darkroom's sustainable load: median, worst over seeds
    best_seed_held: float  # the best seed policy's median sustainable load
    held_ratio: tuple[float, float]
    p99_vs_seed: tuple[float, float]
    p99_vs_ideal: tuple[float, float]
    best_effort_vs_seed: tuple[float, float]

    def line(self) -> str:
        def pair(name: str, x: tuple[float, float]) -> str:
            return f"{name}={_fig(x[0])} (worst {_fig(x[1])})"

        return (
            f"scenario {self.name}: sustainable={_fig(self.held[0])} (worst {_fig(self.held[1])}) "
            f"vs best seed {_fig(self.best_seed_held)}; {pair('sustainable_ratio', self.held_ratio)}; "
            f"{pair('p99_ratio_vs_best_seed', self.p99_vs_seed)}; {pair('p99_ratio_vs_ideal', self.p99_vs_ideal)}; "
            f"{pair('best_effort_throughput_ratio', self.best_effort_vs_seed)}"
        )


def report(
    i: int, path: str, sc: scenarios.Scenario, rows: dict[Key, Row], policies: Sequence[str], seeds: int
) -> tuple[list[str], Verdict]:
    """The lines printed for scenario ``i``, and its verdict figures."""
    seed_ids = [sc.seed + s for s in range(seeds)]
    levels = sorted(set(sc.loads) | set(sc.scan))
    limit = sc.p99_limit_s
    out = [
        f"## scenario {sc.name} ({Path(path).name}): {len(sc.gpus)} GPUs, {len(sc.models)} models, "
        f"{sc.duration_s:.0f}s trace, capacity {sc.capacity_jobs_per_s():.3f} jobs/s on average over its phases; "
        f"trace seeds {seed_ids[0]}..{seed_ids[-1]}; image p99 limit {limit:g}s",
        "",
        f"Each cell: the median over {seeds} trace seeds, the worst seed in brackets. "
        "Best effort: the jobs with no latency target.",
        "",
    ]
    groups = [(p, lv, [rows[(i, p, s, lv)] for s in seed_ids]) for p in policies for lv in sc.loads]
    out += seed_table(groups)
    out += ["", f"Sustainable load (image p99 < {limit:g}s), median (worst) over seeds:"]
    held = {
        p: {s: sustainable([rows[k] for lv in levels if (k := (i, p, s, lv)) in rows], limit) for s in seed_ids}
        for p in policies
    }
    for p in policies:
        mid, bad = _pair(list(held[p].values()), higher_is_better=True)
        out.append(f"- {p}: {mid:.2f} ({bad:.2f})")

    level = 0.85 if 0.85 in sc.loads else max(sc.loads)
    seed_policies = [p for p in SEEDS if p in policies]
    p99_seed: list[float] = []
    p99_ideal: list[float] = []
    best_effort: list[float] = []
    held_ratio: list[float] = []
    for s in seed_ids if "darkroom" in policies else ():
        at = {p: rows[(i, p, s, level)] for p in policies}
        ours = at["darkroom"]
        if seed_policies:
            best = at[min(seed_policies, key=lambda p: _key(at[p].p99("image")))]
            p99_seed.append(ratio(ours.p99("image"), best.p99("image")))
            best_effort.append(ratio(ours.best_effort_throughput, best.best_effort_throughput))
            held_ratio.append(ratio(held["darkroom"][s], max(held[p][s] for p in seed_policies)))
        if IDEAL in at:
            p99_ideal.append(ratio(ours.p99("image"), at[IDEAL].p99("image")))
    verdict = Verdict(
        name=sc.name,
        held=_pair(list(held["darkroom"].values()), higher_is_better=True) if "darkroom" in held else (math.nan,) * 2,
        best_seed_held=max((median(list(held[p].values())) for p in seed_policies), default=math.nan),
        held_ratio=_pair(held_ratio, higher_is_better=True),
        p99_vs_seed=_pair(p99_seed),
        p99_vs_ideal=_pair(p99_ideal),
        best_effort_vs_seed=_pair(best_effort, higher_is_better=True),
    )

    def pair(x: tuple[float, float]) -> str:
        return f"{_fig(x[0])} (worst {_fig(x[1])})"

    out += [
        "",
        f"At {level:.0%}, per seed, then median (worst): darkroom image p99 / the best seed policy's "
        f"{pair(verdict.p99_vs_seed)}; / the ideal's {pair(verdict.p99_vs_ideal)}; darkroom best-effort "
        f"jobs/s / the best seed policy's {pair(verdict.best_effort_vs_seed)}.",
        f"Sustainable load, darkroom / the best seed policy's: {pair(verdict.held_ratio)}; "
        f"darkroom's as a fraction of capacity: {pair(verdict.held)}.",
    ]
    return out, verdict


def _key(p99: float) -> float:
    return math.inf if math.isnan(p99) else p99


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenario",
        action="append",
        help="a scenario TOML file; repeat for several (default: the shipped ones, the default scenario last)",
    )
    parser.add_argument("--seeds", type=int, default=5, help="trace seeds per scenario (default 5)")
    parser.add_argument(
        "--policies",
        default=",".join(ORDER),
        help=f"comma-separated, of {', '.join((*ORDER, *ON_REQUEST))} (default: {', '.join(ORDER)})",
    )
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--loads", help="comma-separated load levels, each scenario's table and scan (default: theirs)")
    parser.add_argument(
        "--smoke", action="store_true", help=f"small values for CI: {SMOKE_SCENARIO.name}, {SMOKE}; given options win"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
        args.scenario = args.scenario or [str(SMOKE_SCENARIO)]
    wanted = {p.strip() for p in args.policies.split(",") if p.strip()}
    unknown = sorted(wanted - set(ORDER) - set(ON_REQUEST))
    if unknown or not wanted:
        print(f"error: unknown policies {unknown}; known: {', '.join((*ORDER, *ON_REQUEST))}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("error: --seeds must be at least 1", file=sys.stderr)
        return 2
    policies = [p for p in (*ORDER[:1], *ON_REQUEST, *ORDER[1:]) if p in wanted]

    if args.scenario:
        paths = list(args.scenario)
    else:
        paths = []
        for name in SHIPPED:
            if (SIMULATOR / name).is_file():
                paths.append(str(SIMULATOR / name))
            else:
                print(f"note: {name} is not there: skipped", file=sys.stderr)
    default = scenarios.DEFAULT_SCENARIO.resolve()
    # The default scenario's figures end the output: it runs last.
    paths.sort(key=lambda p: Path(p).resolve() == default)
    try:
        if not paths:
            raise scenarios.ScenarioError("no scenario to run")
        loaded = [scenarios.load(p) for p in paths]
        if args.loads:
            levels = tuple(float(x) for x in args.loads.split(","))
            loaded = [replace(sc, loads=levels, scan=levels) for sc in loaded]
    except (scenarios.ScenarioError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    started = time.monotonic()
    rows = run_all(paths, loaded, policies, args.seeds, max(1, args.processes))
    verdicts = []
    for i, (path, sc) in enumerate(zip(paths, loaded, strict=True)):
        lines, verdict = report(i, path, sc, rows, policies, args.seeds)
        print("\n".join(lines))
        print()
        verdicts.append(verdict)
    print(f"({len(rows)} simulations in {time.monotonic() - started:.0f}s)", file=sys.stderr)
    for verdict in verdicts:
        print(verdict.line())
    last = verdicts[-1]
    print(f"p99_ratio_vs_best_seed={_fig(last.p99_vs_seed[0])}")
    print(f"sustainable_load={_fig(last.held[0])}/{_fig(last.best_seed_held)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
