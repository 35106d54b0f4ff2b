"""A fleet snapshot from the simulated world: what Darkroom's scheduler would know
of these GPUs and jobs, as ``scheduler.facts`` reads it from the database."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler import snapshot
from scheduler.simulator import joining
from scheduler.simulator.fleet import SimFleet
from scheduler.simulator.world import Gpu, Job
from services.db.counts import SubmittedCount
from services.db.states import WorkerStatus
from services.generation import BatchKey, JobShape

# Every simulated job has the default guidance: the simulator does not model it.
GUIDANCE = 7.5


class WorldFacts:
    """Facts of the simulated world; a job's fact is kept while it stays the same."""

    def __init__(self, *, adapters: bool = True) -> None:
        self._queued: dict[tuple[int, int, frozenset[str]], snapshot.QueuedJob] = {}
        # False: the scheduler is told nothing of adapters (adapter-blind placement).
        self.adapters = adapters

    def queued_job(self, job: Job) -> snapshot.QueuedJob:
        key = (job.id, job.preemptions, job.failed_on)
        fact = self._queued.get(key)
        if fact is None:
            t = job.trace.type
            # A preempted job ages from its suspension, as production's
            # ``aged_from`` has it: it does not outrank at once the job it made
            # room for.
            aged_from = job.suspended_at if job.preemptions and job.suspended_at is not None else job.queued_at
            fact = snapshot.QueuedJob(
                str(job.id),
                JobShape(t.model, t.width, t.height, t.steps, GUIDANCE, t.batch),
                job.trace.lane,
                job.trace.priority,
                aged_from,
                job.failed_on,
                job.trace.tenant,
                frozenset({job.trace.adapter}) if job.trace.adapter and self.adapters else frozenset(),
            )
            self._queued[key] = fact
        return fact

    def worker(self, sim: SimFleet, gpu: Gpu, now: float, primary: str | None) -> snapshot.Worker:
        served = sim.served(gpu)
        return snapshot.Worker(
            id=gpu.id,
            state=WorkerStatus.READY,
            models=served,
            capabilities=frozenset(sim.scenario.models[m].capability for m in served),
            warm_models=frozenset(gpu.loaded),
            vram_total_bytes=gpu.vram_total,
            vram_used_bytes=gpu.vram_used(sim.vram_gb),
            speed=gpu.spec.speed,
            temperature_c=sim.temperature(gpu, now),
            planned_models=gpu.planned,
            primary_model=primary,
            loading_s=gpu.busy_until - now if gpu.preloading is not None else 0.0,
            open_seats=joining.open_seats(gpu, now),
            adapters=frozenset(gpu.adapters) if self.adapters else frozenset(),
            # As a sampler measures it once it has loaded one.
            adapter_load_s=sim.scenario.adapters.load_s if gpu.adapters and self.adapters else 0.0,
            gpus=gpu.spec.gpus,
        )

    @staticmethod
    def progress(gpu: Gpu, jobs: list[Job], now: float) -> snapshot.Progress:
        """Of ``jobs`` of the running batch: their share done when it began, and the
        load and checkpoint read it paid first; in a continuous batch, each
        member's own steps (``joining.progress``)."""
        assert gpu.running is not None
        if gpu.stepped is not None:
            return joining.progress(gpu, jobs, now)
        return snapshot.Progress(
            done=gpu.running.resumed_from,
            elapsed_s=now - gpu.running_since,
            pending_s=gpu.run_load_s + gpu.run_resume_s,
        )

    def held(self, sim: SimFleet, gpu: Gpu, now: float) -> list[snapshot.HeldWork]:
        """What ``gpu`` holds: its running batch, then its queue as it will run it,
        jobs of one type as batches (at the first of them), a resumed job alone."""
        held = []
        # A continuous batch's members of other steps are held apart, as production's
        # records group them (by batch key, the most advanced one's progress).
        running = _by_batch_key(gpu.batch) if gpu.stepped is not None else [gpu.batch] if gpu.batch else []
        for jobs in running:
            held.append(self._work(gpu, jobs, snapshot.Holding.RUNNING, self.progress(gpu, jobs, now)))
        groups: dict[tuple[str, int, int, int], list[Job]] = {}
        order: list[Job | list[Job]] = []
        for job in gpu.queue:
            if job.done:
                order.append(job)
                continue
            t = job.trace.type
            group = groups.get((t.model, t.width, t.height, t.steps))
            if group is None:
                group = groups[(t.model, t.width, t.height, t.steps)] = []
                order.append(group)
            group.append(job)
        resume_s = sim.scenario.resume_s
        for item in order:
            if isinstance(item, list):
                held.append(self._work(gpu, item, snapshot.Holding.WAITING, snapshot.Progress()))
            else:
                resuming = snapshot.Progress(done=item.done, pending_s=resume_s)
                held.append(self._work(gpu, [item], snapshot.Holding.RESUMING, resuming))
        return held

    @staticmethod
    def _work(gpu: Gpu, jobs: list[Job], holding: snapshot.Holding, progress: snapshot.Progress) -> snapshot.HeldWork:
        t = jobs[0].trace.type
        images = [j.trace.type.batch for j in jobs]
        key = BatchKey(t.model, t.width, t.height, t.steps, GUIDANCE)
        return snapshot.HeldWork(gpu.id, key, sum(images), max(images), holding, progress)

    def running(self, sim: SimFleet, now: float) -> list[snapshot.RunningJob]:
        running = []
        for gpu in sim.live():
            if gpu.running is None:
                continue
            for job in gpu.batch:
                progress = self.progress(gpu, [job], now)
                t = job.trace.type
                running.append(
                    snapshot.RunningJob(
                        str(job.id),
                        job.attempts,
                        gpu.id,
                        job.trace.lane,
                        JobShape(t.model, t.width, t.height, t.steps, GUIDANCE, t.batch),
                        job.preemptions,
                        job.suspend_requested,
                        progress,
                    )
                )
        return running

    def fleet_snapshot(self, sim: SimFleet, now: float, primaries: Mapping[str, str | None]) -> snapshot.FleetSnapshot:
        """The pending jobs, and every live GPU with what it holds."""
        live = sim.live()
        return snapshot.FleetSnapshot(
            now=now,
            workers=tuple(self.worker(sim, g, now, primaries.get(g.id)) for g in live),
            queued=tuple(self.queued_job(j) for j in sim.pending),
            held=tuple(h for g in live for h in self.held(sim, g, now)),
        )

    @staticmethod
    def submitted(job: Job, *, newer: bool = False, backlog: bool = False) -> SubmittedCount:
        t = job.trace.type
        return SubmittedCount(t.model, t.width, t.height, t.steps, t.batch, job.trace.lane, newer, 1, backlog)


def _by_batch_key(jobs: list[Job]) -> list[list[Job]]:
    """``jobs`` grouped by batch key (model, size and steps), each group where its
    first job is."""
    groups: dict[tuple[str, int, int, int], list[Job]] = {}
    for job in jobs:
        t = job.trace.type
        groups.setdefault((t.model, t.width, t.height, t.steps), []).append(job)
    return list(groups.values())
