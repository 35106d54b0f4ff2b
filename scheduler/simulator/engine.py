"""The discrete-event simulator: GPUs that load models, run jobs from their own
FIFO (the head job and the later ones of its type, up to the model's batch size, as
one batch, timed by the model's batch curve), heat up, slow down and fail; a trace of
arrivals; and a placement policy that decides where queued jobs go after every event.

Here: the event loop and what each event does to the fleet. The fleet itself (its
GPUs, the jobs waiting, what a policy does to them and how a GPU starts its next
work) is ``fleet``'s; how a batch is made up, timed and stopped at a step boundary
is in ``batches``, and how jobs join a running batch in ``joining``.
"""

from __future__ import annotations

import heapq

from scheduler.simulator import joining
from scheduler.simulator.fleet import ARRIVAL, BOUNDARY, DONE, FAIL, RECOVER, SUSPENDED, TICK, Policy, SimFleet
from scheduler.simulator.scenario import Scenario
from scheduler.simulator.trace import TraceJob
from scheduler.simulator.world import Job, Result


class Simulation(SimFleet):
    def __init__(
        self, scenario: Scenario, policy: Policy, trace: list[TraceJob], *, load: float, continuous: bool = False
    ) -> None:
        super().__init__(scenario, policy, continuous=continuous)
        self.load = load
        self.up_since = dict.fromkeys(self.gpus, 0.0)
        self.up_s = 0.0
        for tj in trace:
            self._push(tj.arrival_s, ARRIVAL, tj)
        for f in scenario.failures:
            self._push(f.at_s, FAIL, f.gpu)
            self._push(f.at_s + f.down_s, RECOVER, f.gpu)
        self._push(0.0, TICK, None)
        self.total = len(trace)

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
                self.up_s += (now - since) * self.gpus[gid].spec.gpus
        return Result(
            policy=self.policy.name,
            load=self.load,
            jobs=self.jobs,
            makespan_s=now,
            cold_loads=self.cold_loads,
            adapter_loads=self.adapter_loads,
            preloads=self.preloads,
            busy_s=sum(g.busy_s * g.spec.gpus for g in self.gpus.values()),  # a group holds its every GPU
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
            self.finished(batch, gpu, run, now)
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
        self.up_s += (now - self.up_since[gpu_id]) * gpu.spec.gpus

    def _recover(self, gpu_id: str, now: float) -> None:
        gpu = self.gpus[gpu_id]
        gpu.up = True
        self.up_since[gpu_id] = now
        # It warms its boot models before it announces itself (seed 000's warm-up).
        for m in gpu.spec.pinned:
            gpu.loaded[m] = now
