"""The simulated fleet as a placement policy sees it and acts on it: its GPUs, what
each has loaded, queued and running, the jobs waiting, and the two things a policy
does (``assign`` a job to a GPU, ``suspend`` a GPU's batch); and how a GPU starts
its next work. The event loop that moves it through time is ``engine``'s.

Every policy sees the same worker behaviour, so only placement differs: a GPU
loads a job's model when the job starts if it is not loaded (a cold load the job
waits for), evicting by (planned, eviction priority, least recently used) until
it fits; a failed GPU's jobs go back to the central queue and it comes back
empty after its downtime, then warms its boot models.

Suspension (only when a policy asks for it, as Darkroom's does where the scenario
configures preemption): the running batch stops at its next step boundary and
writes its checkpoint (``checkpoint_s`` on the GPU), then goes back to the central
queue keeping the steps it did, no failure counted (its next start is a new
attempt, as production's fencing token counts it). A resumed job runs alone (on
any GPU), paying ``resume_s`` (reading its checkpoint back) on top of its remaining
steps and any model load.

With ``continuous=True`` jobs placed on a GPU join its running batch at a step
boundary and leave when their own steps are done (``joining``); how a batch is made
up, timed and stopped at a step boundary is in ``batches``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

from scheduler.simulator import joining
from scheduler.simulator.batches import compute_s, make_room, stop_boundary, take_riders
from scheduler.simulator.scenario import GIB, Scenario
from scheduler.simulator.world import Gpu, Job

# Event kinds, in the order they are handled at the same instant.
DONE, FAIL, RECOVER, ARRIVAL, TICK, SUSPENDED, BOUNDARY = range(7)


class Policy(Protocol):
    name: str

    def dispatch(self, sim: SimFleet, now: float) -> list[tuple[Job, str]]:
        """Assignments of pending jobs to GPUs; jobs not named stay pending."""
        ...

    def on_done(
        self, sim: SimFleet, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None
    ) -> None:
        """``batch``: the jobs that ran together (or left a continuous batch
        together), ``run_s`` the time of the first (without a load), ``rows`` the
        images of the batch it ran in, on average over its steps (None: ``batch``'s)."""
        ...

    def on_tick(self, sim: SimFleet, now: float) -> None: ...


class SimFleet:
    """The fleet of ``scenario``, placed by ``policy``; ``events`` holds what is to
    happen to it, (time, kind, sequence, payload), for the engine to pop."""

    def __init__(self, scenario: Scenario, policy: Policy, *, continuous: bool = False) -> None:
        self.scenario = scenario
        self.policy = policy
        self.continuous = continuous
        self.gpus = {g.id: Gpu(g, int(g.vram_gb * GIB)) for g in scenario.gpus}
        self.vram_gb = {name: m.vram_gb for name, m in scenario.models.items()}
        self.pending: list[Job] = []
        self.jobs: list[Job] = []
        self.arrived: list[Job] = []  # for demand measurement
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.cold_loads = 0
        self.adapter_loads = 0
        self.preloads = 0
        self.suspensions = 0
        self.preloaded: dict[str, int] = {}
        for gpu in self.gpus.values():
            for m in gpu.spec.pinned:
                gpu.loaded[m] = 0.0

    def _push(self, at: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, kind, self._seq, payload))

    # -- what a policy reads -----------------------------------------------------

    def speed(self, gpu: Gpu, now: float) -> float:
        return gpu.spec.speed * self.scenario.temperature(gpu.id, now)[1]

    def run_speed(self, gpu: Gpu, model: str, now: float) -> float:
        """How fast ``gpu`` runs ``model``: a group spanning it, its group's speedup."""
        spec = self.scenario.models[model]
        spans = gpu.spec.gpus > 1 and spec.parallel_size == gpu.spec.gpus
        return self.speed(gpu, now) * (spec.group_speedup if spans else 1.0)

    def temperature(self, gpu: Gpu, now: float) -> float:
        return self.scenario.temperature(gpu.id, now)[0]

    def live(self) -> list[Gpu]:
        return [g for g in self.gpus.values() if g.up]

    def fits(self, gpu: Gpu, model: str) -> bool:
        """Whether ``gpu`` can run ``model`` at all, for every policy: as a
        production sampler advertises, the model is small enough for it and of a
        capability it is let serve."""
        serves = gpu.spec.serves
        capability = self.scenario.models[model].capability
        return self.vram_gb[model] * GIB <= gpu.vram_total and (not serves or capability in serves)

    def served(self, gpu: Gpu) -> frozenset[str]:
        return frozenset(m for m in self.scenario.models if self.fits(gpu, m))

    # -- what a policy does ------------------------------------------------------

    def assign(self, job: Job, gpu_id: str, now: float) -> None:
        gpu = self.gpus[gpu_id]
        assert gpu.up, f"{self.policy.name} placed job {job.id} on {gpu_id}, which is down"
        self.pending.remove(job)
        gpu.queue.append(job)
        self._start_next(gpu, now)

    def suspend(self, gpu_id: str, now: float) -> None:
        """Asks the batch running on ``gpu_id`` to suspend at its next step boundary.
        Asking again changes nothing; a batch whose next boundary is its last step
        just finishes."""
        gpu = self.gpus[gpu_id]
        batch = gpu.batch
        if not batch or any(j.suspend_requested for j in batch):
            return
        for job in batch:
            job.suspend_requested = True
        # Continuous: no steps for all, each member's are counted at the stop.
        stop = (joining.stop_boundary if gpu.stepped is not None else stop_boundary)(gpu, now)
        if stop is None:
            return
        steps, boundary = stop
        gpu.busy_until = boundary + self.scenario.checkpoint_s
        gpu.generation += 1  # its DONE will not come
        self._push(gpu.busy_until, SUSPENDED, (gpu.id, gpu.generation, steps))

    # -- how a GPU works ---------------------------------------------------------

    def wake(self, gpu: Gpu, at: float) -> None:
        """``gpu``'s continuous batch changes next at ``at``: its earlier wake is void."""
        gpu.generation += 1
        self._push(at, BOUNDARY, (gpu.id, gpu.generation))

    def finished(self, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None) -> None:
        """``batch`` ran to its end on ``gpu`` (or left its continuous batch): the
        policy learns it."""
        self.policy.on_done(self, batch, gpu, run_s, now, rows=rows)

    def _start_next(self, gpu: Gpu, now: float) -> None:
        if gpu.stepped is not None:
            joining.offer(self, gpu, now)
        if not gpu.idle:
            return
        if not gpu.queue:
            self._maybe_preload(gpu, now)
            return
        job = gpu.queue.popleft()
        model = self.scenario.models[job.model]
        riders, images = take_riders(gpu, job, model.max_batch)
        for member in (job, *riders):
            member.start_s = now
            member.attempts += 1  # every start, as production's fencing token counts them
            member.resumed_from = member.done
            member.gpu = gpu.id
        load_s = 0.0
        if job.model not in gpu.loaded:
            make_room(gpu, job.model, self.vram_gb, self.scenario.models)
            load_s = model.load_s
            for member in (job, *riders):
                member.cold = True
            self.cold_loads += 1
        gpu.loaded[job.model] = now
        load_s += self._load_adapters(gpu, (job, *riders), now)
        resume_s = self.scenario.resume_s if job.done else 0.0
        if self.continuous:
            joining.start(self, gpu, (job, *riders), load_s, resume_s, now)
            return
        run = compute_s(job, riders, model, images, self.run_speed(gpu, job.model, now))
        gpu.running, gpu.riders, gpu.running_since, gpu.run_s = job, riders, now, load_s + resume_s + run
        gpu.run_load_s, gpu.run_resume_s = load_s, resume_s
        gpu.busy_until = now + load_s + resume_s + run
        self._push(gpu.busy_until, DONE, (gpu.id, gpu.generation, run))

    def _load_adapters(self, gpu: Gpu, batch: Sequence[Job], now: float) -> float:
        """The seconds ``gpu`` takes loading the adapters of ``batch`` it lacks, each
        made resident (the least recently used evicted past its slots)."""
        wanted = sorted({j.trace.adapter for j in batch if j.trace.adapter})
        missing = [a for a in wanted if a not in gpu.adapters]
        for adapter in wanted:
            gpu.adapters[adapter] = now
        while len(gpu.adapters) > self.scenario.adapters.slots:
            idle = [a for a in gpu.adapters if a not in wanted]
            if not idle:
                break  # the batch itself needs more slots than there are: they all stay for it
            del gpu.adapters[min(idle, key=lambda a: (gpu.adapters[a], a))]
        self.adapter_loads += len(missing)
        return len(missing) * self.scenario.adapters.load_s

    def _maybe_preload(self, gpu: Gpu, now: float) -> None:
        missing = [m for m in sorted(gpu.planned) if m not in gpu.loaded and self.fits(gpu, m)]
        if not missing:
            return
        model = max(missing, key=lambda m: self.scenario.models[m].vram_gb)
        make_room(gpu, model, self.vram_gb, self.scenario.models)
        gpu.loaded[model] = now
        gpu.preloading = model
        self.preloads += 1
        self.preloaded[model] = self.preloaded.get(model, 0) + 1
        gpu.busy_until = now + self.scenario.models[model].load_s
        self._push(gpu.busy_until, DONE, (gpu.id, gpu.generation, None))
