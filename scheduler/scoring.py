"""Scoring one job on one worker: when it would finish there, or why it cannot go
there (``scheduler.placement`` decides from these).

The estimate is the work already held there, loading its model if it is not warm
(and reloading whatever must be evicted for it), its own learned duration at that
worker's measured speed, all scaled up on a hot GPU; or the job's growth of a batch
it may join there; or, where the batch running there has a seat for it, its own
steps in that batch from the next step on. Workers that are draining, unhealthy, cannot serve or fit the
model, or that would break a per-capability cap are not candidates."""

from __future__ import annotations

import itertools

from scheduler.policy import (
    Candidate,
    Fleet,
    JobView,
    PlacementKind,
    WorkerView,
    job_seconds,
    joining_seconds,
    seat_join,
    thermal_factor,
)
from services.config.placement import PlacementSettings
from services.db.states import WorkerStatus


def capped_out(capability: str, worker: WorkerView, fleet: Fleet, config: PlacementSettings) -> int | None:
    """The cap that keeps ``capability`` off this worker now, if one does: it is
    reached, other work is queued or running, and the worker holds none of it
    already. (Only a fleet with nothing else to do lets long work spread: a
    video started on every GPU in a lull holds them all when images return.)"""
    cap = config.cap(capability)
    if cap is None or capability in worker.held_capabilities or fleet.busy.get(capability, 0) < cap:
        return None
    others = itertools.chain(fleet.waiting.items(), fleet.busy.items())
    return cap if any(n > 0 for c, n in others if c != capability) else None


def off_share(job: JobView, worker: WorkerView, fleet: Fleet, config: PlacementSettings) -> bool:
    """Whether best-effort ``job`` must keep off ``worker``: where latency classes
    are configured, best-effort work runs on the GPUs the plan gives its model
    (the share latency-bound work does not need), and elsewhere only on a GPU
    with nothing to do that has room for its model beside what is loaded (work
    conserving, without evicting what latency-bound work will want back). So
    too before the first plan: a fleet starting on a burst of long videos would
    otherwise fill every GPU with them."""
    if job.target_s is not None or not config.has_targets or job.model in worker.planned_models:
        return False
    idle = worker.held_jobs == 0 and worker.held_work_s == 0
    room = not worker.vram_total_bytes or (
        job.model in worker.warm_models
        or fleet.costs[job.model].vram_bytes <= worker.vram_total_bytes - worker.vram_used_bytes
    )
    if idle and not room and fleet.planned.get(job.model, 0) == 0:
        # A model the plan gives no GPU (every GPU it fits is latency-bound
        # work's) would starve: it may have an idle one, evicting what no queued
        # job wants, until latency-bound work takes the GPU back by preemption.
        _, evicted = eviction_cost(job.model, worker, fleet, config)
        room = not any(fleet.wanted.get(m, 0) > 0 for m in evicted)
    return not (idle and room)


def eviction_cost(
    model: str, worker: WorkerView, fleet: Fleet, config: PlacementSettings, *, urgent: bool = False
) -> tuple[float, list[str]]:
    """What loading ``model`` on ``worker`` costs in reloads of what it evicts: the
    models the planner does not want there go first, then by eviction priority.
    For ``urgent`` (latency-bound) work, evicting a best-effort model costs
    nothing: best-effort work has no latency to lose."""
    costs = fleet.costs
    need = costs[model].vram_bytes
    free = worker.vram_total_bytes - worker.vram_used_bytes
    if not worker.vram_total_bytes or need <= free:
        return 0.0, []
    victims = sorted(
        (m for m in worker.warm_models if m in costs),
        key=lambda m: (m in worker.planned_models, costs[m].eviction_priority, m),
    )
    cost, evicted = 0.0, []
    for victim in victims:
        if need <= free:
            break
        free += costs[victim].vram_bytes
        evicted.append(victim)
        # Evicting a model the planner wants here costs its reload (the worker
        # loads it back), and so does evicting the fleet's last warm copy of one;
        # neither counts while a cap keeps that model's work off this worker.
        planned = victim in worker.planned_models
        last = fleet.warm.get(victim, 1) <= 1
        if (
            (planned or last)
            and capped_out(costs[victim].capability, worker, fleet, config) is None
            and not (urgent and costs[victim].capability in config.best_effort)
        ):
            cost += costs[victim].load_s
    return cost, evicted


def refusal(model: str, worker: WorkerView, fleet: Fleet) -> Candidate | None:
    """Why ``worker`` can take no job of ``model`` whatever the pass does, if it
    cannot: its state, what it serves, its memory. None: it is scored."""
    cost = fleet.costs[model]
    if worker.state != WorkerStatus.READY:
        return Candidate(worker.id, False, float("inf"), worker.state.value)
    if not worker.serves(cost.capability):
        return Candidate(worker.id, False, float("inf"), f"does not serve {cost.capability}")
    if model not in worker.models:
        return Candidate(worker.id, False, float("inf"), "cannot serve the model")
    if model not in worker.warm_models and worker.vram_total_bytes and cost.vram_bytes > worker.vram_total_bytes:
        return Candidate(worker.id, False, float("inf"), "model does not fit in its memory")
    return None


def _adapters_note(worker: WorkerView, job: JobView) -> str:
    missing = worker.adapters_missing(job)
    if not missing:
        return ""
    return f", loads {len(missing)} adapter{'s' if len(missing) > 1 else ''} (+{worker.adapter_seconds(job):.1f}s)"


def score(job: JobView, worker: WorkerView, fleet: Fleet, config: PlacementSettings) -> Candidate:
    return refusal(job.model, worker, fleet) or admitted(job, worker, fleet, config)


def admitted(job: JobView, worker: WorkerView, fleet: Fleet, config: PlacementSettings) -> Candidate:
    """``score`` for a worker that ``refusal`` lets through."""
    cost = fleet.costs[job.model]
    warm = job.model in worker.warm_models
    cap = capped_out(cost.capability, worker, fleet, config)
    if cap is not None:
        return Candidate(worker.id, False, float("inf"), f"{cost.capability} cap of {cap} GPUs reached")
    if (
        config.cap(cost.capability) is not None
        and fleet.planned.get(job.model, 0) > 0
        and job.model not in worker.planned_models
    ):
        # Capped work is the long kind: started off-plan in a lull, it would hold
        # a GPU the planner counts on for other models for minutes.
        return Candidate(worker.id, False, float("inf"), f"not planned for {job.model}")
    if off_share(job, worker, fleet, config):
        return Candidate(worker.id, False, float("inf"), f"best effort, and not planned for {job.model}")
    # The seed's thermal rule: a hot GPU's wait counts more (2x at 80 C), which
    # steers work to cooler GPUs before the learned speed shows the throttling.
    heat = thermal_factor(worker.temperature_c, config)
    # Its adapters not resident there load before its first step (adapter-aware placement).
    adapters_s, adapters = worker.adapter_seconds(job), _adapters_note(worker, job)
    seated = seat_join(job, worker, fleet)
    if seated is not None:
        # It waits for none of the work held there: it runs beside the batch under way.
        note = f"joins its running batch of {seated.seat.rows} at the next step{adapters}"
        return Candidate(worker.id, True, seated.finish_s + adapters_s, note, has_room=True, kind=PlacementKind.SEAT)
    joining = joining_seconds(job, worker, fleet)
    if joining is not None:
        rows = worker.open_rows(job.batch_key)
        note = f"joins a batch of {rows} (+{joining:.2f}s){adapters}"
        # It waits for no slot of the backlog: the batch is already in it.
        finish = worker.held_work_s * heat + joining + adapters_s
        return Candidate(worker.id, True, finish, note, has_room=True, kind=PlacementKind.BATCH)
    finish = worker.held_work_s * heat + job_seconds(job, worker, fleet) + adapters_s
    note = "warm"
    if not warm:
        urgent = job.target_s is not None
        reload_s, evicted = eviction_cost(job.model, worker, fleet, config, urgent=urgent)
        finish += cost.load_s + reload_s
        note = f"cold (+{cost.load_s:.1f}s load)"
        if evicted:
            note += f", evicts {'+'.join(evicted)}"
        # Near capacity the enemy is thrash: a job may not push out a model this
        # worker is planned to keep while other queued jobs wait for that model,
        # unless the model stays warm on at least as many other workers as
        # there are jobs waiting for it.
        needed = [
            m
            for m in evicted
            if m in worker.planned_models
            and 0 < fleet.wanted.get(m, 0) >= fleet.warm.get(m, 0)
            and not (urgent and fleet.costs[m].capability in config.best_effort)
        ]
        if needed:
            return Candidate(worker.id, False, float("inf"), f"would evict {'+'.join(needed)}, which queued jobs need")
    note += adapters
    if heat > 1.0:
        note += f", hot {worker.temperature_c:.0f}C: wait x{heat:.1f}"
    has_room = worker.held_jobs <= config.backlog_limit
    return Candidate(worker.id, True, finish, note, has_room, PlacementKind.WARM if warm else PlacementKind.COLD)
