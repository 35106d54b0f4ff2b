"""The trace a scenario generates: Poisson arrivals at a load level, bursts and
phases included, each job with its true work and its lane."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from scheduler.simulator.conditions import HEAVY
from scheduler.simulator.scenario import JobType, Scenario
from services.db.tenant_records import DEFAULT_TENANT


@dataclass(frozen=True)
class TraceJob:
    id: int
    type: JobType
    arrival_s: float
    work_s: float  # true seconds at speed 1.0, noise included
    lane: str
    priority: int
    target_s: float | None = None  # its latency target (from its lane and capability); None: best effort
    tenant: str = DEFAULT_TENANT
    adapter: str = ""  # the LoRA adapter it names (NAME:VERSION); "": none

    @property
    def best_effort(self) -> bool:
        return self.target_s is None


def trace(scenario: Scenario, load: float) -> list[TraceJob]:
    """Poisson arrivals at ``load`` x capacity on average, bursts included, the job
    mix following the phases (each phase at ``load`` of its own capacity, so the
    work offered stays level as the mix shifts). The same scenario and load give
    the same trace."""
    rng = random.Random(f"{scenario.seed}:{load}")
    b = scenario.bursts
    # Quiet and burst rates keep the mean at the load level.
    burst_frac = b.length_s / b.every_s if b.every_s else 0.0
    quiet = load / (1 + burst_frac * (b.factor - 1))
    adapters = scenario.adapters
    # Zipf's law over the adapters: the one of rank r weighs r^-zipf.
    popularity = [r**-adapters.zipf for r in range(1, adapters.count + 1)]
    paid = next((lane for lane in scenario.darkroom.lanes if lane.priority > 0), None)
    free = min(scenario.darkroom.lanes, key=lambda lane: lane.priority)
    jobs: list[TraceJob] = []
    now = 0.0
    while True:
        in_burst = bool(b.every_s) and (now % b.every_s) < b.length_s
        phase = next(p for p in reversed(scenario.phases) if p.start_s <= now)
        rate = quiet * (b.factor if in_burst else 1.0) * scenario.phase_capacity(phase)
        now += rng.expovariate(rate)
        if now >= scenario.duration_s:
            return jobs
        phase = next(p for p in reversed(scenario.phases) if p.start_s <= now)
        names = list(phase.weights)
        jt = scenario.job_types[rng.choices(names, weights=[phase.weights[n] for n in names])[0]]
        noise = rng.lognormvariate(-(scenario.noise_sigma**2) / 2, scenario.noise_sigma)
        lane = paid if paid is not None and rng.random() < scenario.paid_share else free
        if jt.lane:  # drawn above all the same: the other jobs' lanes stay as they were
            lane = next(la for la in scenario.darkroom.lanes if la.name == jt.lane)
        target = scenario.darkroom.target_s(lane.name, scenario.models[jt.model].capability)
        tenant = DEFAULT_TENANT
        if scenario.tenants.light:  # drawn last: a trace without tenants stays as it was
            extra = in_burst and rng.random() < (b.factor - 1) / b.factor
            tenant = HEAVY if extra else f"light-{rng.randrange(scenario.tenants.light)}"
        adapter = ""
        if adapters.count and rng.random() < adapters.share:  # drawn last: a trace without adapters stays as it was
            adapter = f"adapter-{rng.choices(range(adapters.count), weights=popularity)[0]}:v1"
        work = scenario.work_s(jt) * noise
        jobs.append(TraceJob(len(jobs), jt, now, work, lane.name, lane.priority, target, tenant, adapter))


def without(jobs: list[TraceJob], tenant: str) -> list[TraceJob]:
    """The trace as it would be had ``tenant`` sent nothing: the others' jobs, as
    they were."""
    kept = [j for j in jobs if j.tenant != tenant]
    return [replace(j, id=i) for i, j in enumerate(kept)]
