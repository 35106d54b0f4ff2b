"""The one way a fleet snapshot becomes decisions: which jobs go where (``place``),
which running jobs make room for the ones left waiting (``preempt``), which models
each GPU keeps warm (``plan_warm``), and what happens to stalled jobs
(``recover``). The scheduler's loops and the simulator both call these, each
having filled a ``FleetSnapshot`` from what it knows; nothing here does I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from scheduler import policy
from scheduler.costs import measured_costs
from scheduler.estimates import Durations
from scheduler.fair_share import fair_turns
from scheduler.forecast import forecast
from scheduler.placement import plan
from scheduler.preemption import Preemption, choose_preemptions
from scheduler.recovery import Recovery, RecoveryConfig, review
from scheduler.snapshot import FleetSnapshot
from scheduler.views import JobViews, gpu_views, running_views, submitted_work, worker_views
from scheduler.warm_planner import WarmSet, plan_warm_sets
from services.config.placement import PlacementSettings, PreemptionSettings
from services.db.states import WorkerStatus


@dataclass(frozen=True)
class PassDecision:
    """What a placement pass saw and decided."""

    placements: list[policy.Placement]  # in the pass's priority order
    jobs: dict[str, policy.JobView]
    lanes: dict[str, str]  # job id -> lane
    workers: list[policy.WorkerView]
    fleet: policy.Fleet  # with the costs corrected by what the workers measured
    now: float

    @property
    def placed(self) -> list[policy.Placement]:
        return [p for p in self.placements if p.worker_id is not None]


def place(
    snapshot: FleetSnapshot,
    costs: Mapping[str, policy.ModelCost],
    durations: Durations,
    placement: PlacementSettings,
    *,
    job_views: JobViews | None = None,
    limit: int | None = None,
    preemption: PreemptionSettings | None = None,
) -> PassDecision:
    """Places the snapshot's queued jobs (at most ``limit`` of them, first in the
    policy's order, when given): see ``scheduler.placement.plan``. ``job_views``
    keeps the views of jobs seen before. ``preemption``: the settings ``preempt``
    will be called with on this decision, so that a job it may act for is scored
    on every worker."""
    fleet = policy.Fleet(measured_costs(costs, snapshot.workers), durations, adapter_load_s=placement.adapter_load_s)
    views = job_views or JobViews(placement, costs)
    jobs = [views(job) for job in snapshot.queued]
    if placement.fair_share:
        jobs = fair_turns(
            jobs,
            snapshot.tenants,
            lambda j: policy.gpu_seconds(j, fleet),
            now=snapshot.now,
            half_life_s=placement.fair_share_half_life_s,
        )
    if limit is not None:
        jobs = policy.order_queue(jobs, placement, now=snapshot.now)[:limit]
    workers = worker_views(snapshot, fleet)
    placements = plan(
        jobs,
        workers,
        fleet,
        placement,
        now=snapshot.now,
        exhaustive=(lambda j: preemption.may_preempt(j.lane, j.target_s)) if preemption is not None else _never,
    )
    lanes = {job.id: job.lane for job in snapshot.queued}
    return PassDecision(placements, {j.id: j for j in jobs}, lanes, workers, fleet, snapshot.now)


def _never(job: policy.JobView) -> bool:
    return False


def waiting_for_room(
    decision: PassDecision, preemption: PreemptionSettings
) -> list[tuple[policy.JobView, str, policy.Placement]]:
    """The pass's jobs that may have running work suspended for them, in its
    order. A job placed behind other work on a worker can only be helped there:
    its placement is narrowed to that worker."""
    waiting = []
    for p in decision.placements:
        job, lane = decision.jobs[p.job_id], decision.lanes[p.job_id]
        if not preemption.may_preempt(lane, job.target_s):
            continue
        if p.worker_id is not None:
            p = replace(p, candidates=tuple(c for c in p.candidates if c.worker_id == p.worker_id))
        waiting.append((job, lane, p))
    return waiting


def preempt(
    decision: PassDecision,
    running: FleetSnapshot,
    preemption: PreemptionSettings,
    placement: PlacementSettings,
    *,
    waiting: Sequence[tuple[policy.JobView, str, policy.Placement]] | None = None,
) -> list[Preemption]:
    """The running jobs (``running.running``) to suspend for the jobs the pass left
    waiting (``waiting_for_room``, unless given): see ``scheduler.preemption``."""
    if waiting is None:
        waiting = waiting_for_room(decision, preemption)
    if not waiting:
        return []
    views = running_views(running, decision.fleet, placement)
    return choose_preemptions(
        waiting, views, preemption, now=decision.now, workers=decision.workers, fleet=decision.fleet
    )


def plan_warm(
    snapshot: FleetSnapshot,
    costs: Mapping[str, policy.ModelCost],
    durations: Durations,
    placement: PlacementSettings,
    *,
    window_s: float,
) -> dict[str, WarmSet] | None:
    """Each worker's warm set from the demand submitted over ``window_s``: see
    ``scheduler.warm_planner``. None with no demand to plan from: the warm sets
    stay as they are."""
    fleet = policy.Fleet(costs, durations)
    submitted = [submitted_work(s, fleet, placement) for s in snapshot.submitted if s.model in costs]
    if not submitted:
        return None
    predicted = forecast(submitted, window_s)
    gpus = gpu_views(snapshot, fleet)
    capacity = sum(g.speed for g in gpus if g.state == WorkerStatus.READY)
    return plan_warm_sets(
        predicted.planning(placement.latency_headroom, capacity),
        gpus,
        measured_costs(costs, snapshot.workers),
        dict(placement.capability_caps),
        best_effort=predicted.best_effort_models,
    )


def recover(snapshot: FleetSnapshot, config: RecoveryConfig) -> list[Recovery]:
    """What to do with the snapshot's stalled jobs: see ``scheduler.recovery``."""
    return review(snapshot, config)
