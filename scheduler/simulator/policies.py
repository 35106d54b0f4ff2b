"""The policies the simulator compares: Darkroom's production policy (through an
adapter that builds its views from the simulated world, exactly as
``scheduler/views.py`` builds them from Postgres) and the seeds' policies,
implemented from their text.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from scheduler.estimates import Durations, observe, with_observation
from scheduler.policy import (
    BatchKey,
    Fleet,
    JobView,
    WorkerView,
    batch_seconds,
    job_seconds,
    order_queue,
    plan,
    queued_batches,
)
from scheduler.preemption import RunningView, choose_preemptions
from scheduler.simulator.engine import Gpu, Job, Simulation
from scheduler.simulator.scenario import GIB, Scenario
from scheduler.warm_planner import GpuView, Submitted, forecast, plan_warm_sets


class DarkroomPolicy:
    """``scheduler.policy.plan`` for placement, ``scheduler.warm_planner`` every
    ``plan_interval_s``, durations and speeds learned with ``scheduler.estimates``,
    and, where the scenario configures it, ``scheduler.preemption`` after each
    pass: the jobs the pass left waiting may have running jobs suspended."""

    name = "darkroom"

    def __init__(self, scenario: Scenario) -> None:
        self.config = scenario.darkroom
        self.preemption = scenario.preemption
        self.costs = {name: m.cost() for name, m in scenario.models.items()}
        # With batching, a job may join an open batch on a worker whose backlog is full.
        self.batching = any(c.max_batch > 1 for c in self.costs.values())
        self.durations = Durations()
        self.batch = scenario.scheduler_batch
        self.views: dict[tuple[int, int, frozenset[str]], JobView] = {}
        self.plan_changes = 0
        self.primaries: dict[str, str | None] = {}

    def job_view(self, job: Job) -> JobView:
        key = (job.id, job.preemptions, job.failed_on)
        view = self.views.get(key)
        if view is None:
            t = job.trace.type
            # A preempted job's priority ages from its suspension, as the
            # scheduler's ``aged_from`` has it: it does not outrank at once the
            # job it made room for.
            aged_from = job.suspended_at if job.preemptions and job.suspended_at is not None else job.queued_at
            view = JobView(
                str(job.id),
                t.model,
                t.width,
                t.height,
                t.steps,
                t.batch,
                job.trace.priority,
                aged_from,
                failed_on=job.failed_on,
                target_s=job.trace.target_s,
            )
            self.views[key] = view
        return view

    def worker_view(self, sim: Simulation, gpu: Gpu, now: float) -> WorkerView:
        work = 0.0
        warm = set(gpu.loaded)
        if gpu.preloading is not None:
            work += gpu.busy_until - now
        fleet = Fleet(self.costs, self.durations)
        # The GPU as the learned durations see it: its id and declared speed.
        estimated = WorkerView(gpu.id, frozenset(), frozenset(), 0, 0, speed=gpu.spec.speed)
        if gpu.running is not None:
            work += self.running_left(gpu, estimated, fleet, now)
        # What is queued runs as batches of one job type, as the GPU will run them;
        # a resumed job alone, for what it has left.
        waiting: dict[BatchKey, list[Job]] = {}
        slots = 1 if gpu.running is not None else 0
        for job in gpu.queue:
            if job.done:
                left = job_seconds(self.job_view(job), estimated, fleet) * (1.0 - job.done)
                work += left + sim.scenario.resume_s
                slots += 1
            else:
                waiting.setdefault(self.job_view(job).batch_key, []).append(job)
            if job.model not in warm:
                work += self.costs[job.model].load_s
                warm.add(job.model)
        for jobs in waiting.values():
            rows = sum(j.trace.type.batch for j in jobs)
            batches, seconds = queued_batches(self.job_view(jobs[0]), rows, estimated, fleet)
            work += seconds
            slots += batches
        return WorkerView(
            id=gpu.id,
            models=frozenset(m for m in self.costs if sim.fits(gpu, m)),
            warm_models=frozenset(gpu.loaded),
            vram_total_bytes=gpu.vram_total,
            vram_used_bytes=gpu.vram_used(sim.vram_gb),
            speed=gpu.spec.speed,
            held_jobs=slots,
            held_work_s=work,
            held_capabilities=frozenset(
                j.capability for j in itertools.chain(gpu.queue, [gpu.running] if gpu.running else [])
            ),
            temperature_c=sim.temperature(gpu, now),
            planned_models=gpu.planned,
            open_batches=tuple(sorted((key, sum(j.trace.type.batch for j in jobs)) for key, jobs in waiting.items())),
        )

    def running_left(self, gpu: Gpu, estimated: WorkerView, fleet: Fleet, now: float) -> float:
        """Estimated seconds until the batch ``gpu`` runs is done."""
        assert gpu.running is not None
        rows = sum(j.trace.type.batch for j in gpu.batch)
        expected = batch_seconds(self.job_view(gpu.running), rows, estimated, fleet) * (1.0 - gpu.running.resumed_from)
        expected += gpu.run_load_s + gpu.run_resume_s
        return max(expected - (now - gpu.running_since), 0.0)

    def running_views(self, sim: Simulation, now: float) -> list[RunningView]:
        """The running jobs as ``scheduler.views.running_views`` builds them from
        Postgres: a step of the batch and what is left of it, as estimated."""
        fleet = Fleet(self.costs, self.durations)
        views = []
        for gpu in sim.live():
            if gpu.running is None:
                continue
            estimated = WorkerView(gpu.id, frozenset(), frozenset(), 0, 0, speed=gpu.spec.speed)
            rows = sum(j.trace.type.batch for j in gpu.batch)
            step_s = batch_seconds(self.job_view(gpu.running), rows, estimated, fleet) / gpu.running.trace.type.steps
            left = self.running_left(gpu, estimated, fleet, now)
            for job in gpu.batch:
                views.append(
                    RunningView(
                        str(job.id),
                        job.attempts,
                        gpu.id,
                        job.trace.lane,
                        job.capability,
                        job.model,
                        job.preemptions,
                        job.suspend_requested,
                        step_s,
                        left,
                        job.trace.target_s,
                    )
                )
        return views

    def dispatch(self, sim: Simulation, now: float) -> list[tuple[Job, str]]:
        live = sim.live()
        preempting = self.preemption.enabled
        if not self.batching and not preempting and not any(g.held <= self.config.backlog_limit for g in live):
            return []  # no worker has room: the pass could only explain, not place
        by_id = {str(j.id): j for j in sim.pending}
        queue = order_queue([self.job_view(j) for j in sim.pending], self.config, now=now)[: self.batch]
        workers = [self.worker_view(sim, g, now) for g in live]
        fleet = Fleet(self.costs, self.durations)
        placements = plan(queue, workers, fleet, self.config, now=now)
        if preempting:
            views = {v.id: v for v in queue}
            waiting = [
                (views[p.job_id], by_id[p.job_id].trace.lane, p)
                for p in placements
                if p.worker_id is None
                and self.preemption.may_preempt(by_id[p.job_id].trace.lane, by_id[p.job_id].trace.target_s)
            ]
            if waiting:
                running = self.running_views(sim, now)
                for chosen in choose_preemptions(
                    waiting, running, self.preemption, now=now, workers=workers, fleet=fleet
                ):
                    sim.suspend(chosen.worker_id, now)
        return [(by_id[p.job_id], p.worker_id) for p in placements if p.worker_id is not None]

    def on_done(self, sim: Simulation, batch: list[Job], gpu: Gpu, run_s: float, now: float) -> None:
        if any(j.resumed_from for j in batch):
            return  # a resumed run is part of a job (and a checkpoint read): nothing to learn from
        # Learned as the scheduler learns from workers: once per batch, under its images.
        shape = replace(self.job_view(batch[0]).shape, batch=sum(j.trace.type.batch for j in batch))
        cost = self.costs[batch[0].model]
        obs = observe(self.durations, shape, cost.step_s_512, gpu.id, run_s, gpu.spec.speed)
        self.durations = with_observation(self.durations, shape, gpu.id, obs)

    def submitted(self, job: Job, *, newer: bool = False, backlog: bool = False) -> Submitted:
        view = self.job_view(job)
        seconds = self.durations.shape_seconds(view.shape, self.costs[job.model].step_s_512)
        return Submitted(job.model, seconds, newer, self.config.plans_as_latency_bound(view.target_s), backlog)

    def on_tick(self, sim: Simulation, now: float) -> None:
        window = sim.scenario.demand_window_s
        submitted = []
        for job in reversed(sim.arrived):
            if job.queued_at < now - window:
                break
            submitted.append(self.submitted(job, newer=job.queued_at >= now - window / 2))
        # Queued from before the window: the backlog, as production's query finds it.
        submitted += [self.submitted(job, backlog=True) for job in sim.pending if job.queued_at < now - window]
        if not submitted:
            return
        gpus = [
            GpuView(
                g.id,
                frozenset(m for m in self.costs if sim.fits(g, m)),
                frozenset(g.loaded),
                g.vram_total,
                self.durations.speed(g.id, g.spec.speed),
                primary=self.primaries.get(g.id),
            )
            for g in sim.live()
        ]
        caps = dict(self.config.capability_caps)
        predicted = forecast(submitted, window)
        demand = predicted.planning(self.config.latency_headroom, sum(g.speed for g in gpus))
        plans = plan_warm_sets(demand, gpus, self.costs, caps, best_effort=predicted.best_effort_models)
        for gpu_id, warm in plans.items():
            if sim.gpus[gpu_id].planned != warm.models:
                self.plan_changes += 1
            sim.gpus[gpu_id].planned = warm.models
            self.primaries[gpu_id] = warm.primary


class _Immediate:
    """Seed policies with per-GPU queues: every job is placed on arrival."""

    name = ""

    def pick(self, sim: Simulation, job: Job, gpus: list[Gpu]) -> Gpu:
        raise NotImplementedError

    def dispatch(self, sim: Simulation, now: float) -> list[tuple[Job, str]]:
        live = sim.live()
        for job in list(sim.pending):
            able = [g for g in live if sim.fits(g, job.model)]
            if able:
                sim.assign(job, self.pick(sim, job, able).id, now)
        return []  # assigned one by one: each pick sees the queues the last one left

    def on_done(self, sim: Simulation, batch: list[Job], gpu: Gpu, run_s: float, now: float) -> None:
        pass

    def on_tick(self, sim: Simulation, now: float) -> None:
        pass


class RoundRobin(_Immediate):
    name = "round-robin"

    def __init__(self, scenario: Scenario) -> None:
        self.turn = itertools.count()

    def pick(self, sim: Simulation, job: Job, gpus: list[Gpu]) -> Gpu:
        return gpus[next(self.turn) % len(gpus)]


class ShortestQueue(_Immediate):
    """Seed 002: each GPU keeps its own queue; a new request goes to the GPU with
    the shortest one, avoiding faulty GPUs."""

    name = "shortest-queue"

    def __init__(self, scenario: Scenario) -> None:
        pass

    def pick(self, sim: Simulation, job: Job, gpus: list[Gpu]) -> Gpu:
        return min(gpus, key=lambda g: g.held)


class ModelAffinity(_Immediate):
    """Seed 001: the first GPU with the model loaded and room in its queue; else
    the GPU with the most free VRAM that fits it without evicting; else the least
    busy GPU, which will evict."""

    name = "model-affinity"

    def __init__(self, scenario: Scenario) -> None:
        self.max_depth = scenario.seeds.max_queue_depth

    def pick(self, sim: Simulation, job: Job, gpus: list[Gpu]) -> Gpu:
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

    def _capable(self, sim: Simulation, job: Job, gpu: Gpu, busy: bool) -> bool:
        if job.model not in self.tags[gpu.id] or not sim.fits(gpu, job.model):
            return False
        if job.capability == "video" and busy:
            return gpu.id in self.video_workers[: self.busy_video]
        return True

    def dispatch(self, sim: Simulation, now: float) -> list[tuple[Job, str]]:
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

    def on_done(self, sim: Simulation, batch: list[Job], gpu: Gpu, run_s: float, now: float) -> None:
        pass

    def on_tick(self, sim: Simulation, now: float) -> None:
        pass


POLICIES = {p.name: p for p in (DarkroomPolicy, RoundRobin, ShortestQueue, LoadRatio, ModelAffinity)}
SEEDS = ("round-robin", "shortest-queue", "load-ratio", "model-affinity")
