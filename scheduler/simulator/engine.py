"""The discrete-event simulator: GPUs that load models, run jobs from their own
FIFO (the head job and the later ones of its type, up to the model's batch size, as
one batch, timed by the model's batch curve), heat up, slow down and fail; a trace of
arrivals; and a placement policy that decides where queued jobs go after every event.

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
boundary and leave when their own steps are done (``joining``). Here: the event loop
and what each event does to the world; how a batch is made up, timed and stopped at
a step boundary is in ``batches``.
"""

from __future__ import annotations

import heapq

from scheduler.simulator import joining
from scheduler.simulator.batches import compute_s, make_room, stop_boundary, take_riders
from scheduler.simulator.scenario import GIB, Scenario
from scheduler.simulator.trace import TraceJob
from scheduler.simulator.world import Gpu, Job, Policy, Result

# Event kinds, in the order they are handled at the same instant.
DONE, FAIL, RECOVER, ARRIVAL, TICK, SUSPENDED, BOUNDARY = range(7)


class Simulation:
    def __init__(
        self, scenario: Scenario, policy: Policy, trace: list[TraceJob], *, load: float, continuous: bool = False
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.load = load
        self.continuous = continuous
        self.gpus = {g.id: Gpu(g, int(g.vram_gb * GIB)) for g in scenario.gpus}
        self.vram_gb = {name: m.vram_gb for name, m in scenario.models.items()}
        self.pending: list[Job] = []
        self.jobs: list[Job] = []
        self.arrived: list[Job] = []  # for demand measurement
        self.events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.cold_loads = 0
        self.preloads = 0
        self.suspensions = 0
        self.preloaded: dict[str, int] = {}
        self.up_since = dict.fromkeys(self.gpus, 0.0)
        self.up_s = 0.0
        for gpu in self.gpus.values():
            for m in gpu.spec.pinned:
                gpu.loaded[m] = 0.0
        for tj in trace:
            self._push(tj.arrival_s, ARRIVAL, tj)
        for f in scenario.failures:
            self._push(f.at_s, FAIL, f.gpu)
            self._push(f.at_s + f.down_s, RECOVER, f.gpu)
        self._push(0.0, TICK, None)
        self.total = len(trace)

    def _push(self, at: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self.events, (at, kind, self._seq, payload))

    # -- the world ---------------------------------------------------------------

    def speed(self, gpu: Gpu, now: float) -> float:
        return gpu.spec.speed * self.scenario.temperature(gpu.id, now)[1]

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
        resume_s = self.scenario.resume_s if job.done else 0.0
        if self.continuous:
            joining.start(self, gpu, (job, *riders), load_s, resume_s, now)
            return
        run = compute_s(job, riders, model, images, self.speed(gpu, now))
        gpu.running, gpu.riders, gpu.running_since, gpu.run_s = job, riders, now, load_s + resume_s + run
        gpu.run_load_s, gpu.run_resume_s = load_s, resume_s
        gpu.busy_until = now + load_s + resume_s + run
        self._push(gpu.busy_until, DONE, (gpu.id, gpu.generation, run))

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

    def wake(self, gpu: Gpu, at: float) -> None:
        """``gpu``'s continuous batch changes next at ``at``: its earlier wake is void."""
        gpu.generation += 1
        self._push(at, BOUNDARY, (gpu.id, gpu.generation))

    def assign(self, job: Job, gpu_id: str, now: float) -> None:
        gpu = self.gpus[gpu_id]
        assert gpu.up, f"{self.policy.name} placed job {job.id} on {gpu_id}, which is down"
        self.pending.remove(job)
        gpu.queue.append(job)
        self._start_next(gpu, now)

    # -- the loop ----------------------------------------------------------------

    def run(self, *, max_pending: int = 4000) -> Result:
        now = 0.0
        overloaded = False
        while self.events:
            now, kind, _, payload = heapq.heappop(self.events)
            if kind == ARRIVAL:
                assert isinstance(payload, TraceJob)
                capability = self.scenario.models[payload.type.model].capability
                job = Job(payload, capability, now)
                self.jobs.append(job)
                self.pending.append(job)
                self.arrived.append(job)
            elif kind == DONE:
                self._done(payload, now)
            elif kind == FAIL:
                self._fail(str(payload), now)
            elif kind == RECOVER:
                self._recover(str(payload), now)
            elif kind == TICK:
                self.policy.on_tick(self, now)
                self._push(now + self.scenario.plan_interval_s, TICK, None)
            elif kind == SUSPENDED:
                self._suspended(payload, now)
            elif kind == BOUNDARY:
                assert isinstance(payload, tuple)
                gpu = self.gpus[payload[0]]
                if payload[1] == gpu.generation and joining.boundary(self, gpu, now):
                    self._start_next(gpu, now)  # its batch ended
            # Events at the same instant settle before the policy looks.
            if self.events and self.events[0][0] == now:
                continue
            if self.pending:
                for job, gpu_id in self.policy.dispatch(self, now):
                    self.assign(job, gpu_id, now)
            for gpu in self.live():
                self._start_next(gpu, now)
            if len(self.pending) > max_pending or now > 4 * self.scenario.duration_s:
                overloaded = True
                break
            if len(self.jobs) == self.total and all(j.finish_s is not None for j in self.jobs[-50:]):
                if all(j.finish_s is not None for j in self.jobs):
                    break
        for gid, since in self.up_since.items():
            if self.gpus[gid].up:
                self.up_s += now - since
        return Result(
            policy=self.policy.name,
            load=self.load,
            jobs=self.jobs,
            makespan_s=now,
            cold_loads=self.cold_loads,
            preloads=self.preloads,
            busy_s=sum(g.busy_s for g in self.gpus.values()),
            up_s=self.up_s,
            overloaded=overloaded,
            suspensions=self.suspensions,
        )

    def _done(self, payload: object, now: float) -> None:
        assert isinstance(payload, tuple)
        gpu_id: str = payload[0]
        generation: int = payload[1]
        run: float | None = payload[2]
        gpu = self.gpus[gpu_id]
        if generation != gpu.generation:
            return
        if gpu.preloading is not None:
            gpu.busy_s += self.scenario.models[gpu.preloading].load_s
            gpu.preloading = None
        else:
            batch = gpu.batch
            assert batch and run is not None
            for job in batch:
                job.finish_s = now
                job.done, job.suspend_requested = 1.0, False
            gpu.busy_s += gpu.run_s
            gpu.running, gpu.riders = None, []
            gpu.loaded[batch[0].model] = now
            self.policy.on_done(self, batch, gpu, run, now)
        self._start_next(gpu, now)

    def _suspended(self, payload: object, now: float) -> None:
        assert isinstance(payload, tuple)
        gpu_id: str = payload[0]
        generation: int = payload[1]
        steps: int | None = payload[2]
        gpu = self.gpus[gpu_id]
        if generation != gpu.generation:
            return
        # Continuous: each member's share done is counted at the stop.
        batch = joining.stop(self, gpu, now - self.scenario.checkpoint_s) if gpu.stepped is not None else gpu.batch
        for job in batch:
            if steps is not None:
                job.done = job.resumed_from + steps / batch[0].trace.type.steps
            job.preemptions += 1
            job.suspend_requested, job.suspended_at = False, now
            self.pending.append(job)
        self.pending.sort(key=lambda j: j.queued_at)
        self.suspensions += 1
        gpu.busy_s += now - gpu.running_since
        gpu.running, gpu.riders = None, []
        gpu.loaded[batch[0].model] = now
        # Nothing starts here before the policy has looked: the GPU was freed for
        # a waiting job (the loop starts queued work after the policy's pass).

    def _fail(self, gpu_id: str, now: float) -> None:
        gpu = self.gpus[gpu_id]
        lost = list(gpu.queue) + gpu.batch
        if gpu.running is not None:
            gpu.busy_s += now - gpu.running_since
        for job in gpu.batch:
            job.failed_on |= {gpu_id}  # a started attempt failed there; queued ones just go back
        for job in lost:
            job.start_s, job.cold, job.suspend_requested = None, False, False
            self.pending.append(job)
        self.pending.sort(key=lambda j: j.queued_at)
        gpu.queue.clear()
        gpu.running, gpu.riders, gpu.stepped, gpu.preloading, gpu.up = None, [], None, None, False
        gpu.loaded.clear()
        gpu.generation += 1
        self.up_s += now - self.up_since[gpu_id]

    def _recover(self, gpu_id: str, now: float) -> None:
        gpu = self.gpus[gpu_id]
        gpu.up = True
        self.up_since[gpu_id] = now
        # It warms its boot models before it announces itself (seed 000's warm-up).
        for m in gpu.spec.pinned:
            gpu.loaded[m] = now
