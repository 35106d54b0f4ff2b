"""Fair sharing measured: a scenario with tenants (``[tenants]``) run three ways on
one trace: fair sharing on, fair sharing off, and the light tenants alone (the
trace without the heavy tenant's jobs), each through Darkroom's policy."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from scheduler.simulator import trace as traces
from scheduler.simulator.conditions import HEAVY
from scheduler.simulator.engine import Simulation
from scheduler.simulator.policies import DarkroomPolicy
from scheduler.simulator.report import percentile, summarize
from scheduler.simulator.scenario import Scenario


class Run(enum.StrEnum):
    FAIR = "fair"  # fair sharing on (the default)
    UNFAIR = "unfair"  # fair sharing off: the lane's jobs oldest first, whoever's
    ALONE = "alone"  # the light tenants' jobs only, fair sharing on


@dataclass(frozen=True)
class FairRow:
    light_p99_s: float  # image p99 of the light tenants' jobs, submit to done
    heavy_jobs_per_s: float  # the heavy tenant's jobs finished per second of the run
    utilisation: float  # GPU busy time over GPU up time
    overloaded: bool


def fair_run(scenario: Scenario, load: float, run: Run) -> FairRow:
    jobs = traces.trace(scenario, load)
    if run is Run.ALONE:
        jobs = traces.without(jobs, HEAVY)
    if run is Run.UNFAIR:
        scenario = replace(scenario, darkroom=replace(scenario.darkroom, fair_share=False))
    result = Simulation(scenario, DarkroomPolicy(scenario), jobs, load=load).run()
    light = [j.finish_s - j.trace.arrival_s for j in result.jobs if j.finish_s is not None and j.trace.tenant != HEAVY]
    heavy = sum(1 for j in result.jobs if j.finish_s is not None and j.trace.tenant == HEAVY)
    return FairRow(
        percentile(light, 99),
        heavy / result.makespan_s if result.makespan_s else 0.0,
        summarize(result).utilisation,
        result.overloaded,
    )
