"""Continuous batching in the event engine (``Simulation(continuous=True)``), as
Darkroom's samplers run it (``gpu_worker/denoising/running_batch.py``): a GPU's running
batch takes the jobs placed on it whose join key (model and size; any steps) is
its own at its next step boundary, from the head of its queue while each fits in
the model's ``max_batch`` images (the first that does not stops them, so older
work of another shape is never jumped); a member leaves as soon as its own steps
are done, and the batch ends when none is left. A resumed job starts a batch of
its own, as it does batch-at-start (here its checkpoint read is GPU time), and
joins none.

A step takes the members' mean work per image and step times the model's batch
factor at the batch's images, over the GPU's speed. The members change only at
boundaries where one joins or leaves, so the engine wakes a GPU only there and
counts the steps between (exact, and one event per change, not per step).

What a sampler's heartbeat and job records would say of such a batch, for the
simulator's facts: its open seat (``open_seats``) and how far its members are
(``progress``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from scheduler.simulator.scenario import Scenario
from scheduler.simulator.world import Gpu, Job, Member, SteppedBatch
from scheduler.snapshot import Progress
from services.generation import JoinKey
from services.seats import OpenSeat


class Stepping(Protocol):
    """What continuous batching uses of the simulation (``fleet.SimFleet``): the
    models, a GPU's speed, a wake at a GPU's next change, and the policy told of the
    jobs that left."""

    scenario: Scenario

    def speed(self, gpu: Gpu, now: float) -> float: ...

    def run_speed(self, gpu: Gpu, model: str, now: float) -> float: ...

    def wake(self, gpu: Gpu, at: float) -> None: ...

    def finished(self, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None) -> None: ...


def join_key(job: Job) -> JoinKey:
    t = job.trace.type
    return JoinKey(t.model, t.width, t.height)


def start(sim: Stepping, gpu: Gpu, jobs: Sequence[Job], load_s: float, resume_s: float, now: float) -> None:
    """``jobs`` start a batch on ``gpu`` at ``now``; its steps begin once its model
    is loaded and a resumed job's checkpoint read."""
    begins = now + load_s + resume_s
    members = [Member(j, round(j.trace.type.steps * (1.0 - j.done)), stepping=True, joined_at=begins) for j in jobs]
    batch = SteppedBatch(members, sim.scenario.models[jobs[0].model].max_batch, since=begins)
    gpu.stepped = batch
    gpu.running_since, gpu.run_load_s, gpu.run_resume_s = now, load_s, resume_s
    batch.step_s = _step_s(sim, gpu, now)
    _sync(gpu)
    _take_joiners(gpu, now, running=False)
    sim.wake(gpu, _next_change(batch, now))


def offer(sim: Stepping, gpu: Gpu, now: float) -> None:
    """Jobs placed on ``gpu`` while its batch runs: those that can join it do."""
    batch = gpu.stepped
    assert batch is not None
    if _take_joiners(gpu, now, running=True):
        sim.wake(gpu, _next_change(batch, now))


def _take_joiners(gpu: Gpu, now: float, *, running: bool) -> bool:
    """The jobs at the head of ``gpu``'s queue that can join its batch do, at its
    next boundary: started now (as a sampler starts a job it offers its batch),
    stepping from then; ``running``: the batch has begun (they joined it, rather
    than start with it). A batch asked to suspend takes no one. Whether any did."""
    batch = gpu.stepped
    assert batch is not None
    if not gpu.queue or any(m.job.suspend_requested for m in batch.members):
        return False
    key, rows, joined = join_key(batch.members[0].job), batch.rows, False
    while gpu.queue:
        job = gpu.queue[0]
        if job.done or join_key(job) != key or rows + job.trace.type.batch > batch.max_rows:
            break
        if job.trace.adapter and job.trace.adapter not in gpu.adapters:
            # A joiner whose adapter must load first would hold the batch's step for
            # the load: the simulator has it start a batch of its own instead.
            break
        gpu.queue.popleft()
        rows += job.trace.type.batch
        job.start_s, job.gpu, job.resumed_from, job.joined = now, gpu.id, 0.0, running
        job.attempts += 1
        batch.members.append(Member(job, job.trace.type.steps, stepping=False))
        joined = True
    if joined:
        _sync(gpu)
    return joined


def boundary(sim: Stepping, gpu: Gpu, now: float) -> bool:
    """``gpu``'s batch is at a boundary where it changes: who is done leaves, who
    was offered joins. Whether the batch ended (the GPU is free)."""
    batch = gpu.stepped
    assert batch is not None
    model = batch.members[0].job.model
    _leave(sim, gpu, now)
    if not batch.members:
        gpu.busy_s += now - gpu.running_since
        gpu.loaded[model] = now
        gpu.running, gpu.riders, gpu.stepped = None, [], None
        return True
    for m in batch.members:
        if not m.stepping:
            m.stepping, m.joined_at = True, now
    batch.step_s = _step_s(sim, gpu, now)
    _take_joiners(gpu, now, running=True)
    sim.wake(gpu, _next_change(batch, now))
    return False


def stop_boundary(gpu: Gpu, now: float) -> tuple[None, float] | None:
    """When ``gpu``'s batch, asked at ``now`` to suspend, stops: its next
    boundary (as ``batches.stop_boundary`` says it, no steps common to all);
    None when every member is done there (it just finishes)."""
    batch = gpu.stepped
    assert batch is not None
    at = _next_boundary(batch, now)
    steps = _steps_between(batch, at)
    if all(m.stepping and m.steps_left <= steps for m in batch.members):
        return None
    return None, at


def stop(sim: Stepping, gpu: Gpu, at: float) -> list[Job]:
    """``gpu``'s batch stops at the boundary ``at``: who is done there leaves; the
    rest, returned, keep the share of their steps they did."""
    batch = gpu.stepped
    assert batch is not None
    _leave(sim, gpu, at)
    for m in batch.members:
        m.job.done = 1.0 - m.steps_left / m.job.trace.type.steps
    gpu.stepped = None
    return [m.job for m in batch.members]


def open_seats(gpu: Gpu, now: float) -> tuple[OpenSeat, ...]:
    """The room in ``gpu``'s batch, as its sampler's heartbeat says it: the images
    in it (those offered included), those it can still take, and the most steps a
    member has left, the step under way counted."""
    batch = gpu.stepped
    if batch is None or any(j.suspend_requested for j in gpu.batch):
        return ()
    free = batch.max_rows - batch.rows
    steps_left = max(_left(batch, m, now) for m in batch.members)
    if free < 1 or steps_left < 1:
        return ()
    return (OpenSeat(join_key(batch.members[0].job), batch.rows, free, steps_left),)


def progress(gpu: Gpu, jobs: Sequence[Job], now: float) -> Progress:
    """How far ``jobs`` (members of ``gpu``'s batch) are, as the most advanced of
    them: the share of its steps done, and the batch's time into its step under
    way (or, before its steps begin, its load and checkpoint read)."""
    batch = gpu.stepped
    assert batch is not None
    ids = {id(j) for j in jobs}
    members = [m for m in batch.members if id(m.job) in ids]
    done = max(1.0 - _left(batch, m, now) / m.job.trace.type.steps for m in members)
    if now < batch.since:
        return Progress(done=done, elapsed_s=now - gpu.running_since, pending_s=batch.since - gpu.running_since)
    return Progress(done=done, elapsed_s=now - batch.since - _steps_between(batch, now) * batch.step_s)


def _leave(sim: Stepping, gpu: Gpu, now: float) -> None:
    """Counts the steps to ``now`` (a boundary); the members done leave, their
    run learned as a sampler reports it: once, from the first, under the images
    it ran beside on average."""
    batch = gpu.stepped
    assert batch is not None
    steps = _steps_between(batch, now)
    rows = sum(m.job.trace.type.batch for m in batch.members if m.stepping)
    for m in batch.members:
        if m.stepping:
            m.steps_left -= steps
            m.steps_run += steps
            m.row_steps += rows * steps
    batch.since = max(batch.since, now)
    left = [m for m in batch.members if m.stepping and m.steps_left <= 0]
    if not left:
        return
    batch.members = [m for m in batch.members if not (m.stepping and m.steps_left <= 0)]
    if batch.members:
        _sync(gpu)
    for m in left:
        m.job.finish_s, m.job.done, m.job.suspend_requested = now, 1.0, False
    first = left[0]
    mean_rows = round(first.row_steps / max(first.steps_run, 1))
    sim.finished([m.job for m in left], gpu, now - first.joined_at, now, rows=mean_rows)


def _step_s(sim: Stepping, gpu: Gpu, now: float) -> float:
    batch = gpu.stepped
    assert batch is not None
    jobs = [m.job for m in batch.members]
    per_image = sum(j.trace.work_s / (j.trace.type.steps * j.trace.type.batch) for j in jobs) / len(jobs)
    model = jobs[0].model
    return per_image * sim.scenario.models[model].batch_factor(batch.rows) / sim.run_speed(gpu, model, now)


def _steps_between(batch: SteppedBatch, now: float) -> int:
    """The batch's whole steps from its latest boundary to ``now``."""
    if now <= batch.since:
        return 0
    return math.floor((now - batch.since) / batch.step_s + 1e-9)


def _next_boundary(batch: SteppedBatch, now: float) -> float:
    if now <= batch.since:
        return batch.since
    return batch.since + math.ceil((now - batch.since) / batch.step_s - 1e-9) * batch.step_s


def _next_change(batch: SteppedBatch, now: float) -> float:
    """The next boundary where a member leaves, or one joins."""
    change = batch.since + min(m.steps_left for m in batch.members if m.stepping) * batch.step_s
    if not all(m.stepping for m in batch.members):
        change = min(change, _next_boundary(batch, now))
    return change


def _left(batch: SteppedBatch, member: Member, now: float) -> int:
    """``member``'s steps left at ``now``, the step under way counted."""
    return member.steps_left - _steps_between(batch, now) if member.stepping else member.steps_left


def _sync(gpu: Gpu) -> None:
    """The engine's view of the batch (its head, the rest riding) follows its members."""
    assert gpu.stepped is not None
    gpu.running, *gpu.riders = (m.job for m in gpu.stepped.members)
