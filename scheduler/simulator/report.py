"""Figures from simulation results: latency percentiles per job kind, throughput,
cold loads, utilisation, and the sustainable load of each policy."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.simulator.world import Result


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[rank]


@dataclass(frozen=True)
class Row:
    policy: str
    load: float
    throughput: float  # jobs per second completed over the whole run
    latency: dict[str, tuple[float, float, float]]  # kind -> p50, p95, p99 seconds
    cold_loads: int
    preloads: int
    utilisation: float
    overloaded: bool
    # Best-effort jobs (no latency target): jobs per second finished, and p50, p95, p99.
    best_effort_throughput: float = 0.0
    best_effort_latency: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    adapter_loads: int = 0  # LoRA adapters loaded onto GPUs (the adapters scenario)

    def p99(self, kind: str) -> float:
        return math.inf if self.overloaded else self.latency.get(kind, (math.nan,) * 3)[2]

    def best_effort_p99(self) -> float:
        return math.inf if self.overloaded else self.best_effort_latency[2]


def summarize(result: Result) -> Row:
    by_kind: dict[str, list[float]] = {}
    best_effort: list[float] = []
    for job in result.jobs:
        if job.finish_s is not None:
            by_kind.setdefault(job.capability, []).append(job.finish_s - job.trace.arrival_s)
            if job.trace.best_effort:
                best_effort.append(job.finish_s - job.trace.arrival_s)
    done = sum(len(v) for v in by_kind.values())
    return Row(
        policy=result.policy,
        load=result.load,
        throughput=done / result.makespan_s if result.makespan_s else 0.0,
        latency={k: (percentile(v, 50), percentile(v, 95), percentile(v, 99)) for k, v in sorted(by_kind.items())},
        cold_loads=result.cold_loads,
        adapter_loads=result.adapter_loads,
        preloads=result.preloads,
        utilisation=result.busy_s / result.up_s if result.up_s else 0.0,
        overloaded=result.overloaded,
        best_effort_throughput=len(best_effort) / result.makespan_s if result.makespan_s else 0.0,
        best_effort_latency=(percentile(best_effort, 50), percentile(best_effort, 95), percentile(best_effort, 99)),
    )


def by_lane(result: Result) -> dict[str, tuple[float, float, float]]:
    """p50, p95 and p99 latency (arrival to finish) of the finished jobs of each lane."""
    lanes: dict[str, list[float]] = {}
    for job in result.jobs:
        if job.finish_s is not None:
            lanes.setdefault(job.trace.lane, []).append(job.finish_s - job.trace.arrival_s)
    return {k: (percentile(v, 50), percentile(v, 95), percentile(v, 99)) for k, v in sorted(lanes.items())}


def sustainable(rows: Iterable[Row], limit_s: float) -> float:
    """The highest load reached, scanning up from the lowest, before image p99
    first passes ``limit_s`` (0 if even the lowest fails)."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r.load):
        if not row.p99("image") < limit_s:
            break
        best = row.load
    return best


def _fmt(x: float) -> str:
    return "overload" if math.isinf(x) else ("-" if math.isnan(x) else f"{x:.1f}")


def table(rows: Sequence[Row], kinds: Sequence[str]) -> list[str]:
    header = ["policy", "load", "jobs/s"]
    for k in kinds:
        header += [f"{k} p50", f"{k} p95", f"{k} p99"]
    header += ["cold loads", "preloads", "GPU util"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.policy, f"{r.load:.0%}", f"{r.throughput:.3f}"]
        for k in kinds:
            lat = r.latency.get(k, (math.nan,) * 3)
            cells += ["overload" if r.overloaded else _fmt(v) for v in lat]
        cells += [str(r.cold_loads), str(r.preloads), f"{r.utilisation:.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# -- over several trace seeds -------------------------------------------------------


def median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN (NaN if there are none); of an
    even count, the mean of the middle two, taken in sorted order, so the same
    values give the same figure in any order."""
    kept = sorted(v for v in values if not math.isnan(v))
    if not kept:
        return math.nan
    mid = len(kept) // 2
    return kept[mid] if len(kept) % 2 else (kept[mid - 1] + kept[mid]) / 2


def worst(values: Iterable[float], *, higher_is_better: bool = False) -> float:
    """The worst of the values that are not NaN: the highest of latencies and
    ratios where lower is better, the lowest of throughputs and loads."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan
    return min(kept) if higher_is_better else max(kept)


def spread(values: Sequence[float], fmt: str = ".1f", *, higher_is_better: bool = False) -> str:
    """``median (worst)`` of the values, or the one value; ``overload`` for infinity, ``-`` for none."""

    def one(x: float) -> str:
        return "overload" if math.isinf(x) else ("-" if math.isnan(x) else format(x, fmt))

    mid, bad = median(values), worst(values, higher_is_better=higher_is_better)
    return one(mid) if len(values) < 2 else f"{one(mid)} ({one(bad)})"


def _latency(row: Row, kind: str, i: int) -> float:
    return math.inf if row.overloaded else row.latency.get(kind, (math.nan,) * 3)[i]


def seed_table(groups: Sequence[tuple[str, float, Sequence[Row]]]) -> list[str]:
    """A markdown table, a row per (policy, load, the rows of its trace seeds):
    each cell the median over the seeds with the worst seed's figure in brackets."""
    header = [
        "policy",
        "load",
        "jobs/s",
        "image p50 s",
        "image p95 s",
        "image p99 s",
        "best-effort p99 s",
        "best-effort jobs/s",
        "cold loads",
        "GPU util",
    ]
    # A scenario whose jobs name adapters: how many each policy loaded.
    adapters = any(r.adapter_loads for _, _, rows in groups for r in rows)
    header += ["adapter loads"] if adapters else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for policy, load, rows in groups:
        cells = [policy, f"{load:.0%}", spread([r.throughput for r in rows], ".3f", higher_is_better=True)]
        cells += [spread([_latency(r, "image", i) for r in rows]) for i in range(3)]
        cells.append(spread([r.best_effort_p99() for r in rows]))
        cells.append(spread([r.best_effort_throughput for r in rows], ".3f", higher_is_better=True))
        cells.append(spread([float(r.cold_loads) for r in rows], ".0f"))
        cells.append(f"{median([r.utilisation for r in rows]):.0%}")
        if adapters:
            cells.append(spread([float(r.adapter_loads) for r in rows], ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines
