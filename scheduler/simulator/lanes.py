"""Latency per lane under Darkroom's policy, with the scenario's preemption and
without it, on the same traces:

    python -m scheduler.simulator.lanes [--scenario FILE] [--loads 0.7,0.85]

(default: ``preemption_scenario.toml`` beside this file, at its ``loads``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from scheduler.simulator import scenario as scenarios
from scheduler.simulator import trace as traces
from scheduler.simulator.engine import Simulation
from scheduler.simulator.policies import DarkroomPolicy
from scheduler.simulator.report import by_lane
from scheduler.simulator.world import Result
from services.config.placement import PreemptionSettings

PREEMPTION_SCENARIO = Path(__file__).with_name("preemption_scenario.toml")


def run(sc: scenarios.Scenario, load: float, *, preempt: bool) -> Result:
    if not preempt:
        sc = replace(sc, preemption=PreemptionSettings(for_targets=False))
    return Simulation(sc, DarkroomPolicy(sc), traces.trace(sc, load), load=load).run()


def table(sc: scenarios.Scenario, loads: list[float]) -> list[str]:
    lanes = [lane.name for lane in sorted(sc.darkroom.lanes, key=lambda lane: -lane.priority)]
    header = ["preemption", "load", *(f"{lane} p50/p95/p99 s" for lane in lanes), "suspensions", "GPU util"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for load in loads:
        for preempt in (False, True):
            result = run(sc, load, preempt=preempt)
            latency = by_lane(result)
            cells = ["on" if preempt else "off", f"{load:.0%}"]
            for lane in lanes:
                cells.append("/".join(f"{x:.1f}" for x in latency[lane]) if lane in latency else "-")
            util = result.busy_s / result.up_s if result.up_s else 0.0
            cells += ["overload" if result.overloaded else str(result.suspensions), f"{util:.0%}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default=str(PREEMPTION_SCENARIO))
    parser.add_argument("--loads", help="comma-separated fractions of capacity (default: the scenario's)")
    args = parser.parse_args(argv)
    try:
        sc = scenarios.load(args.scenario)
        loads = [float(x) for x in args.loads.split(",")] if args.loads else list(sc.loads)
    except (scenarios.ScenarioError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not sc.preemption.enabled:
        print(f"note: {sc.name} configures no preemption: both rows are the same", file=sys.stderr)
    pre = sc.preemption
    print(
        f"scenario {sc.name}: {len(sc.gpus)} GPUs, {sc.duration_s:.0f}s trace; "
        f"preemptible {','.join(sorted(pre.preemptible)) or '-'}, "
        f"preempting lanes {','.join(sorted(pre.preempting_lanes)) or '-'}, "
        f"max {pre.max_preemptions} per job, after {pre.preempt_after_s:g}s; "
        f"checkpoint {sc.checkpoint_s:g}s, resume {sc.resume_s:g}s"
    )
    print("\n".join(table(sc, loads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
