"""Figures from simulation results: latency percentiles per job kind, throughput,
cold loads, utilisation, and the sustainable load of each policy."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.simulator.engine import Result


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

    def p99(self, kind: str) -> float:
        return math.inf if self.overloaded else self.latency.get(kind, (math.nan,) * 3)[2]


def summarize(result: Result) -> Row:
    by_kind: dict[str, list[float]] = {}
    for job in result.jobs:
        if job.finish_s is not None:
            by_kind.setdefault(job.capability, []).append(job.finish_s - job.trace.arrival_s)
    done = sum(len(v) for v in by_kind.values())
    return Row(
        policy=result.policy,
        load=result.load,
        throughput=done / result.makespan_s if result.makespan_s else 0.0,
        latency={k: (percentile(v, 50), percentile(v, 95), percentile(v, 99)) for k, v in sorted(by_kind.items())},
        cold_loads=result.cold_loads,
        preloads=result.preloads,
        utilisation=result.busy_s / result.up_s if result.up_s else 0.0,
        overloaded=result.overloaded,
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
