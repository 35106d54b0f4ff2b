"""The policies the simulator compares: Darkroom's production policy (the
scheduler's own driver, over a fleet snapshot of the simulated world) and the
seeds' policies, implemented from their text.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from scheduler import driver
from scheduler.estimates import Durations, Shape, observe, with_observation
from scheduler.fair_share import charged
from scheduler.policy import WorkerView, speed_id
from scheduler.simulator.facts import WorldFacts
from scheduler.simulator.fleet import SimFleet
from scheduler.simulator.scenario import GIB, Scenario
from scheduler.simulator.world import Gpu, Job
from scheduler.snapshot import FleetSnapshot, TenantUsage
from scheduler.views import JobViews


class DarkroomPolicy:
    """Darkroom's scheduler in the simulated world: a fleet snapshot of it
    (``scheduler.simulator.facts``) through the production driver
    (``scheduler.driver``): placement after every event, preemption after each
    pass where the scenario configures it, warm sets every ``plan_interval_s``;
    durations and speeds learned with ``scheduler.estimates``."""

    name = "darkroom"
    adapter_aware = True

    def __init__(self, scenario: Scenario) -> None:
        self.config = scenario.darkroom
        self.preemption = scenario.preemption
        self.costs = {name: m.cost() for name, m in scenario.models.items()}
        # With batching, a job may join an open batch on a worker whose backlog is full.
        self.batching = any(c.max_batch > 1 for c in self.costs.values())
        self.durations = Durations()
        self.batch = scenario.scheduler_batch
        self.facts = WorldFacts(adapters=self.adapter_aware)
        self.job_views = JobViews(self.config, self.costs)
        self.plan_changes = 0
        self.primaries: dict[str, str | None] = {}
        # Each tenant's GPU-seconds, as production's settlement adds them up
        # (where the scenario has tenants: otherwise every job is one tenant's).
        self.tenants = scenario.tenants.light > 0
        self.usage: dict[str, TenantUsage] = {}

    def dispatch(self, sim: SimFleet, now: float) -> list[tuple[Job, str]]:
        preempting = self.preemption.enabled
        if not self.batching and not preempting and not any(g.held <= self.config.backlog_limit for g in sim.live()):
            return []  # no worker has room: the pass could only explain, not place
        fleet = self.facts.fleet_snapshot(sim, now, self.primaries)
        if self.usage:
            fleet = replace(fleet, tenants=tuple(self.usage.values()))
        decision = driver.place(
            fleet,
            self.costs,
            self.durations,
            self.config,
            job_views=self.job_views,
            limit=self.batch,
            preemption=self.preemption if preempting else None,
        )
        if preempting:
            waiting = driver.waiting_for_room(decision, self.preemption)
            if waiting:
                running = replace(fleet, running=tuple(self.facts.running(sim, now)))
                for chosen in driver.preempt(decision, running, self.preemption, self.config, waiting=waiting):
                    sim.suspend(chosen.worker_id, now)
        by_id = {str(j.id): j for j in sim.pending}
        return [(by_id[p.job_id], p.worker_id) for p in decision.placed if p.worker_id is not None]

    def on_done(
        self, sim: SimFleet, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None
    ) -> None:
        # The images it ran beside: a batch's own, or a continuous batch's on average.
        images = rows or sum(j.trace.type.batch for j in batch)
        if self.tenants:
            half_life = self.config.fair_share_half_life_s
            for job in batch:  # each its images' share of the batch's time, as the samplers charge
                usage = self.usage.get(job.trace.tenant) or TenantUsage(job.trace.tenant, at=now)
                seconds = run_s * job.trace.type.batch / images
                self.usage[job.trace.tenant] = charged(usage, seconds, now=now, half_life_s=half_life)
        if any(j.resumed_from for j in batch):
            return  # a resumed run is part of a job (and a checkpoint read): nothing to learn from
        # Learned as the scheduler learns from workers: once per batch, under its images.
        t = batch[0].trace.type
        shape = Shape(t.model, t.width * t.height, t.steps, images)
        cost = self.costs[batch[0].model]
        worker = WorkerView(gpu.id, frozenset(), frozenset(), 0, 0, speed=gpu.spec.speed, gpus=gpu.spec.gpus)
        key, declared = speed_id(worker, cost)  # a group's spanning runs are learned apart
        obs = observe(self.durations, shape, cost.step_s_512, key, run_s, declared)
        self.durations = with_observation(self.durations, shape, key, obs)

    def on_tick(self, sim: SimFleet, now: float) -> None:
        window = sim.scenario.demand_window_s
        submitted = []
        for job in reversed(sim.arrived):
            if job.queued_at < now - window:
                break
            submitted.append(self.facts.submitted(job, newer=job.queued_at >= now - window / 2))
        # Queued from before the window: the backlog, as production's query finds it.
        submitted += [self.facts.submitted(job, backlog=True) for job in sim.pending if job.queued_at < now - window]
        workers = tuple(self.facts.worker(sim, g, now, self.primaries.get(g.id)) for g in sim.live())
        fleet = FleetSnapshot(now=now, workers=workers, submitted=tuple(submitted))
        plans = driver.plan_warm(fleet, self.costs, self.durations, self.config, window_s=window)
        for gpu_id, warm in (plans or {}).items():
            if sim.gpus[gpu_id].planned != warm.models:
                self.plan_changes += 1
            sim.gpus[gpu_id].planned = warm.models
            self.primaries[gpu_id] = warm.primary


class _Immediate:
    """Seed policies with per-GPU queues: every job is placed on arrival."""

    name = ""

    def pick(self, sim: SimFleet, job: Job, gpus: list[Gpu]) -> Gpu:
        raise NotImplementedError

    def dispatch(self, sim: SimFleet, now: float) -> list[tuple[Job, str]]:
        live = sim.live()
        for job in list(sim.pending):
            able = [g for g in live if sim.fits(g, job.model)]
            if able:
                sim.assign(job, self.pick(sim, job, able).id, now)
        return []  # assigned one by one: each pick sees the queues the last one left

    def on_done(
        self, sim: SimFleet, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None
    ) -> None:
        pass

    def on_tick(self, sim: SimFleet, now: float) -> None:
        pass


class RoundRobin(_Immediate):
    name = "round-robin"

    def __init__(self, scenario: Scenario) -> None:
        self.turn = itertools.count()

    def pick(self, sim: SimFleet, job: Job, gpus: list[Gpu]) -> Gpu:
        return gpus[next(self.turn) % len(gpus)]


class ShortestQueue(_Immediate):
    """Seed 002: each GPU keeps its own queue; a new request goes to the GPU with
    the shortest one, avoiding faulty GPUs."""

    name = "shortest-queue"

    def __init__(self, scenario: Scenario) -> None:
        pass

    def pick(self, sim: SimFleet, job: Job, gpus: list[Gpu]) -> Gpu:
        return min(gpus, key=lambda g: g.held)


class ModelAffinity(_Immediate):
    """Seed 001: the first GPU with the model loaded and room in its queue; else
    the GPU with the most free VRAM that fits it without evicting; else the least
    busy GPU, which will evict."""

    name = "model-affinity"

    def __init__(self, scenario: Scenario) -> None:
        self.max_depth = scenario.seeds.max_queue_depth

    def pick(self, sim: SimFleet, job: Job, gpus: list[Gpu]) -> Gpu:
        for gpu in gpus:
            if job.model in gpu.loaded and gpu.held < self.max_depth:
                return gpu
        need = sim.vram_gb[job.model] * GIB
        for gpu in sorted(gpus, key=lambda g: g.vram_total - g.vram_used(sim.vram_gb), reverse=True):
            if gpu.vram_total - gpu.vram_used(sim.vram_gb) >= need:
                return gpu
        return min(gpus, key=lambda g: g.held)


class LoadRatio:
    """Seed 000: workers tagged with capabilities and a concurrency; a job goes to
    a warm worker below its concurrency, else any capable one below it (cold),
    lowest inflight/concurrency first, the measured speed score breaking ties.
    Jobs with no such worker wait in a central queue (paid lane drained first)
    and the pick is re-run as workers free up. Video may use every capable worker
    while nothing waits, and only ``busy_video_workers`` of them while jobs queue."""

    name = "load-ratio"

    def __init__(self, scenario: Scenario) -> None:
        self.concurrency = scenario.seeds.concurrency
        self.busy_video = scenario.seeds.busy_video_workers
        self.tags = {g.id: set(g.capabilities or scenario.models) for g in scenario.gpus}
        # Busy-time video goes to the GPUs that pin a video model, then the
        # slowest: the fast ones are kept for images, as the seed's operator would.
        video = {name for name, m in scenario.models.items() if m.capability == "video"}
        self.video_workers = [
            g.id
            for g in sorted(scenario.gpus, key=lambda g: (not video & set(g.pinned), g.speed))
            if video & self.tags[g.id]
        ]

    def _capable(self, sim: SimFleet, job: Job, gpu: Gpu, busy: bool) -> bool:
        if job.model not in self.tags[gpu.id] or not sim.fits(gpu, job.model):
            return False
        if job.capability == "video" and busy:
            return gpu.id in self.video_workers[: self.busy_video]
        return True

    def dispatch(self, sim: SimFleet, now: float) -> list[tuple[Job, str]]:
        live = sim.live()
        for job in sorted(sim.pending, key=lambda j: (-j.trace.priority, j.queued_at)):
            busy = len(sim.pending) > 1
            able = [g for g in live if self._capable(sim, job, g, busy) and g.held < self.concurrency]
            warm = [g for g in able if job.model in g.loaded]
            candidates = warm or able
            if candidates:
                best = min(candidates, key=lambda g: (g.held / self.concurrency, -g.spec.speed))
                sim.assign(job, best.id, now)
        return []

    def on_done(
        self, sim: SimFleet, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None
    ) -> None:
        pass

    def on_tick(self, sim: SimFleet, now: float) -> None:
        pass


class AdapterBlindPolicy(DarkroomPolicy):
    """Darkroom's scheduler told nothing of adapters: neither a job's nor a GPU's
    resident ones (the placement of a server whose batches share one adapter set,
    or that ignores which GPU holds which). What adapter-aware placement is weighed against."""

    name = "darkroom-adapter-blind"
    adapter_aware = False


POLICIES = {
    p.name: p for p in (DarkroomPolicy, AdapterBlindPolicy, RoundRobin, ShortestQueue, LoadRatio, ModelAffinity)
}
SEEDS = ("round-robin", "shortest-queue", "load-ratio", "model-affinity")
