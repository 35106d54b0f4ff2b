"""Preemption: which running jobs to suspend so that urgent waiting jobs can start.

A running job can be suspended at a denoising step boundary: its checkpoint is
stored and it goes back to the queue, to resume later on any GPU with nothing
lost and no attempt counted. The scheduler uses that to keep latency-bound lanes
from waiting behind long best-effort work. Pure: frozen snapshots in, decisions
out, the clock passed in; the scheduler and the simulator call the same rule.

The rule, for each waiting job given (those the placement pass left queued, or
placed behind other work with their candidates narrowed to that worker), in the
order given (the pass's priority order):

1. It may preempt only when preemption is enabled and either its lane is one of
   ``preempting_lanes`` and its estimated wait is more than ``preempt_after_s``,
   or (``for_targets``) it has a latency target and would miss it: the time it
   has waited plus its earliest estimated finish passes ``target_share`` of the
   target. Its wait on
   a worker is its candidate's ``finish_s`` less what it would take there were
   that worker free (its run, and its model's load when not warm there); its
   estimated wait is the least of those over its eligible candidates.
2. Room already being made counts first: an eligible candidate running a job that
   is already asked to suspend (``suspend_requested``), and that no earlier
   waiting job claimed in this call, is claimed by this job, which then asks for
   nothing new.
3. Otherwise a worker may be freed for it when it is an eligible candidate (it
   serves and fits the model) and every job it runs is preemptible: its lane or
   its model's capability is in ``preemptible``, it has been preempted fewer than
   ``max_preemptions`` times, and it is not already asked to suspend. With
   ``for_targets`` every best-effort job (no latency target) counts as listed,
   and a job with a target is never preemptible. A job of a
   preempting lane is never preemptible, even when its capability is listed:
   urgent work must not suspend urgent work. A worker running a batch is freed
   only by suspending the whole batch, one ``Preemption`` per job in it.
4. Freeing must help: on the freed worker the job must be estimated to finish
   sooner than on its best candidate now (a worker's other held work still runs
   before it, and a cold worker still loads the model).
5. Of the workers that may be freed, the one that frees for it soonest: the
   running job's step (the time until it can be suspended) plus whatever else
   the worker would still run before the job (its backlog, and what jobs ahead
   in the pass reserved there), then where the job would finish soonest, then
   the fewest preemptions already suffered, then job id, so the answer never
   depends on the running jobs' order nor on hash seeds.

Each running job is suspended for at most one waiting job: a worker freed (or
claimed) for one waiting job is not offered to the next.

The freed worker is not held for the job it was freed for: the next pass places
what ranks first. So the suspended job's priority must age afresh from its
suspension (the scheduler's ``aged_from``), or it would outrank at once the job
it made room for and take its GPU back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.policy import Candidate, Fleet, JobView, Placement, WorkerView, job_seconds
from services.config.placement import PreemptionSettings


@dataclass(frozen=True)
class RunningView:
    """One running job (built from ``services.db.records.RunningJobRecord``)."""

    job_id: str
    attempt: int
    worker_id: str
    lane: str
    capability: str
    model: str
    preemptions: int
    suspend_requested: bool
    step_s: float  # estimated seconds of one of its steps on its worker (time until it can be suspended)
    remaining_s: float  # estimated seconds until it finishes
    target_s: float | None = None  # its latency target; None: best effort


def preemptible(job: RunningView, settings: PreemptionSettings) -> bool:
    """Whether ``job`` may be suspended for other work (``suspend_requested``
    aside): listed by lane or capability (or best effort, with ``for_targets``),
    not of a preempting lane nor latency-bound, and not preempted
    ``max_preemptions`` times already."""
    listed = job.lane in settings.preemptible or job.capability in settings.preemptible
    if settings.for_targets:
        if job.target_s is not None:
            return False  # latency-bound work is never suspended for other work
        listed = True
    return listed and job.lane not in settings.preempting_lanes and job.preemptions < settings.max_preemptions


@dataclass(frozen=True)
class Preemption:
    job_id: str
    attempt: int
    worker_id: str
    for_job_id: str  # the waiting job it makes room for
    reason: str  # human-readable, goes into logs and the job's suspension record


def running_estimates(job: JobView, worker: WorkerView, fleet: Fleet, *, steps_done: float) -> tuple[float, float]:
    """(step_s, remaining_s) of a running job on ``worker``: one of its steps and
    what is left after ``steps_done`` of them, from the learned durations. Both
    infinite for a model the fleet has no cost for: such a job is never chosen."""
    if job.model not in fleet.costs or job.steps <= 0:
        return math.inf, math.inf
    step = job_seconds(job, worker, fleet) / job.steps
    return step, step * max(job.steps - steps_done, 0.0)


def own_seconds(job: JobView, worker: WorkerView | None, fleet: Fleet | None) -> float:
    """What ``job`` takes on ``worker`` were the worker free: its run, and its
    model's load when it is not warm there. 0 when the worker or the fleet is
    not known, so that the job's whole finish counts as its wait."""
    if worker is None or fleet is None or job.model not in fleet.costs:
        return 0.0
    seconds = job_seconds(job, worker, fleet)
    if job.model not in worker.warm_models:
        seconds += fleet.costs[job.model].load_s
    return seconds


def estimated_wait(job: JobView, placement: Placement, workers: Mapping[str, WorkerView], fleet: Fleet | None) -> float:
    """The least, over the placement's eligible candidates, of how long ``job``
    would wait there before it starts (infinite when none is eligible)."""
    return min(
        (_wait(job, c, workers, fleet) for c in placement.candidates if c.eligible),
        default=math.inf,
    )


def _misses_target(job: JobView, placement: Placement, config: PreemptionSettings, *, now: float) -> bool:
    """Whether ``job``, by where the pass could put it, is estimated to finish
    past its latency target (only with ``for_targets``)."""
    if not config.for_targets or job.target_s is None:
        return False
    best = min((c.finish_s for c in placement.candidates if c.eligible), default=math.inf)
    return max(now - job.queued_at, 0.0) + best > job.target_s * config.target_share


def _wait(job: JobView, c: Candidate, workers: Mapping[str, WorkerView], fleet: Fleet | None) -> float:
    return max(c.finish_s - own_seconds(job, workers.get(c.worker_id), fleet), 0.0)


@dataclass(frozen=True)
class _Room:
    """A worker that could start the waiting job once the jobs it runs are suspended."""

    candidate: Candidate
    jobs: tuple[RunningView, ...]  # what it runs, by job id
    free_s: float  # until the waiting job could start there
    finish_s: float  # until the waiting job would be done there

    @property
    def key(self) -> tuple[float, float, int, tuple[str, ...]]:
        return (self.free_s, self.finish_s, max(j.preemptions for j in self.jobs), tuple(j.job_id for j in self.jobs))


def _room(c: Candidate, jobs: tuple[RunningView, ...], wait_s: float, own_s: float) -> _Room:
    # Suspending takes the running jobs' remaining work off the worker and puts a
    # step (the time until they reach a boundary) in its place; whatever else the
    # worker holds still runs before the waiting job.
    step = max(j.step_s for j in jobs)
    remaining = max(j.remaining_s for j in jobs)
    free = max(wait_s - remaining, 0.0) + step
    return _Room(c, jobs, free, free + own_s)


def _rooms(
    job: JobView,
    placement: Placement,
    held: Mapping[str, tuple[RunningView, ...]],
    taken: set[str],
    views: Mapping[str, WorkerView],
    fleet: Fleet | None,
    config: PreemptionSettings,
) -> tuple[list[_Room], list[_Room]]:
    """The workers among ``job``'s eligible candidates, not taken yet, where room
    is already being made (a suspension asked for), and those that may be freed."""
    pending: list[_Room] = []
    free: list[_Room] = []
    for c in placement.candidates:
        jobs = held.get(c.worker_id)
        if not c.eligible or not jobs or c.worker_id in taken:
            continue
        room = _room(c, jobs, _wait(job, c, views, fleet), own_seconds(job, views.get(c.worker_id), fleet))
        if any(j.suspend_requested for j in jobs):
            pending.append(room)
        elif all(preemptible(j, config) for j in jobs):
            free.append(room)
    return pending, free


def choose_preemptions(
    waiting: Sequence[tuple[JobView, str, Placement]],
    running: Sequence[RunningView],
    config: PreemptionSettings,
    *,
    now: float,
    workers: Sequence[WorkerView] = (),
    fleet: Fleet | None = None,
) -> list[Preemption]:
    """The running jobs to suspend for ``waiting`` (job, its lane, its placement in
    this pass, in the pass's priority order); see the module docstring for the
    rule. A worker running a batch gives one ``Preemption`` per job in it.

    ``workers`` and ``fleet`` (the pass's) let a waiting job's wait be told from
    its own run time on each worker; without them its whole estimated finish
    counts as waiting, which preempts more readily. ``now`` is the pass's clock
    (on the waiting jobs' ``queued_at`` scale); it only goes into the reasons.
    """
    if not config.enabled or not waiting or not running:
        return []
    views = {w.id: w for w in workers}
    by_worker: dict[str, list[RunningView]] = {}
    for r in running:
        by_worker.setdefault(r.worker_id, []).append(r)
    held = {wid: tuple(sorted(jobs, key=lambda j: j.job_id)) for wid, jobs in by_worker.items()}
    taken: set[str] = set()  # workers claimed or freed in this call: each serves one waiting job
    chosen: list[Preemption] = []
    for job, lane, placement in waiting:
        if not config.may_preempt(lane, job.target_s):
            continue
        wait = estimated_wait(job, placement, views, fleet)
        listed = lane in config.preempting_lanes and wait > config.preempt_after_s
        if not (listed or _misses_target(job, placement, config, now=now)):
            continue
        pending, free = _rooms(job, placement, held, taken, views, fleet, config)
        if pending:
            # Room is already being made where it can run: it waits for that.
            taken.add(min(pending, key=lambda r: r.key).candidate.worker_id)
            continue
        best_now = min((c.finish_s for c in placement.candidates if c.eligible), default=math.inf)
        helpful = [r for r in free if r.finish_s < best_now]
        if not helpful:
            continue
        room = min(helpful, key=lambda r: r.key)
        taken.add(room.candidate.worker_id)
        waited = max(now - job.queued_at, 0.0)
        for victim in room.jobs:
            reason = (
                f"preempted for {job.id} ({lane}), waiting {waited:.1f}s and estimated to wait {wait:.1f}s more "
                f"(over {config.preempt_after_s:g}s): {victim.job_id} ({victim.lane}, {victim.capability}) "
                f"suspends at its next step, freeing {victim.worker_id} for it in ~{room.free_s:.1f}s "
                f"and done in ~{room.finish_s:.1f}s "
                f"instead of ~{best_now:.1f}s"
            )
            chosen.append(Preemption(victim.job_id, victim.attempt, victim.worker_id, job.id, reason))
    return chosen
