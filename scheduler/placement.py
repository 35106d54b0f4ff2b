"""Placement: pure functions over the policy's views, the clock passed in; ``plan``
is what the driver calls.

A job goes to the worker where it is estimated to *finish* soonest: the work
already held there, loading its model if it is not warm (and reloading whatever
must be evicted for it), its own learned duration at that worker's measured speed,
all scaled up on a hot GPU. Workers that are draining, unhealthy, cannot serve or
fit the model, or that would break a per-capability cap are not candidates.

Late binding: a worker holds at most ``backlog_limit`` jobs beyond the one it runs.
When the best worker's backlog is full the job waits centrally, reserving its place
there, rather than going to a worse worker: it waits for a warm GPU when that ends
sooner than loading the model on an idle one. Later jobs in the same pass see the
reservation, so the queue spills onto cold GPUs only when waiting would cost more.

Batching: a worker runs queued jobs of one batch key (model, size, steps,
guidance) together, up to the model's ``max_batch`` images. A job that can join a
batch a worker holds but has not started costs that worker only what the batch
grows by (from the learned durations of each batch size), and takes no place in
its backlog: so compatible jobs gather on one GPU and batches form across the
fleet, where the learned durations say a bigger batch costs less per image.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.policy import (
    Candidate,
    Fleet,
    JobView,
    Placement,
    PlacementKind,
    WorkerView,
    job_seconds,
    joining_seconds,
    order_queue,
    thermal_factor,
)
from services.config.placement import PlacementSettings
from services.db.states import WorkerStatus
from services.generation import BatchKey


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


def score(job: JobView, worker: WorkerView, fleet: Fleet, config: PlacementSettings) -> Candidate:
    return refusal(job.model, worker, fleet) or _score(job, worker, fleet, config)


def _score(job: JobView, worker: WorkerView, fleet: Fleet, config: PlacementSettings) -> Candidate:
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
    joining = joining_seconds(job, worker, fleet)
    if joining is not None:
        rows = worker.open_rows(job.batch_key)
        note = f"joins a batch of {rows} (+{joining:.2f}s)"
        # It waits for no slot of the backlog: the batch is already in it.
        return Candidate(
            worker.id, True, worker.held_work_s * heat + joining, note, has_room=True, kind=PlacementKind.BATCH
        )
    finish = worker.held_work_s * heat + job_seconds(job, worker, fleet)
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
    if heat > 1.0:
        note += f", hot {worker.temperature_c:.0f}C: wait x{heat:.1f}"
    has_room = worker.held_jobs <= config.backlog_limit
    return Candidate(worker.id, True, finish, note, has_room, PlacementKind.WARM if warm else PlacementKind.COLD)


@dataclass(frozen=True)
class Refusals:
    """For one model, in one pass: the workers that can take none of its jobs
    (``refusal``), each with its candidate, and whether any worker serves its
    capability or the model at all. Nothing a pass does changes these, so a pass
    works them out once per model, not once per job and worker."""

    by_worker: Mapping[str, Candidate]
    capability_served: bool
    model_served: bool

    @classmethod
    def of(cls, model: str, workers: Sequence[WorkerView], fleet: Fleet) -> Refusals:
        capability = fleet.costs[model].capability
        refused = {w.id: c for w in workers if (c := refusal(model, w, fleet)) is not None}
        return cls(refused, any(w.serves(capability) for w in workers), any(model in w.models for w in workers))


def place(
    job: JobView,
    workers: Sequence[WorkerView],
    fleet: Fleet,
    config: PlacementSettings,
    refusals: Refusals | None = None,
    near: Nearness | None = None,
) -> Placement:
    """Where ``job`` goes, of ``workers``. With ``near`` (``Nearness`` of these
    workers) only the workers that could beat the best found so far are scored:
    the decision is the same, its candidates those scored."""
    if job.model not in fleet.costs:
        return Placement(job.id, None, f"unknown model {job.model!r}", ())
    if refusals is None:
        refusals = Refusals.of(job.model, workers, fleet)
    refused = refusals.by_worker
    if near is None or job.failed_on:
        candidates = tuple(refused.get(w.id) or _score(job, w, fleet, config) for w in workers)
    else:
        candidates = _nearest(job, workers, near, refused, fleet, config)
    if job.failed_on:
        # A retry goes to another GPU (the one that failed it may be broken),
        # unless none other can take it.
        candidates = tuple(
            replace(c, eligible=False, note="an attempt failed there")
            if c.eligible
            and c.worker_id in job.failed_on
            and any(o.eligible and o.worker_id not in job.failed_on for o in candidates)
            else c
            for c in candidates
        )
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        capability = fleet.costs[job.model].capability
        if not refusals.capability_served:
            return Placement(job.id, None, f"no live sampler serves {capability}", candidates, waiting_for=capability)
        reason = "no worker can take it now" if refusals.model_served else "no live worker serves the model"
        return Placement(job.id, None, reason, candidates)
    best = min(eligible, key=lambda c: (c.finish_s, c.worker_id))
    if not best.has_room:
        # A start now on a warm worker beats a reservation estimated up to
        # ``spill_within`` times sooner: the reservation's estimate only grows as
        # more urgent work arrives and goes ahead of it, and the warm worker with
        # room is otherwise idle. (A cold one would add a load and its evictions.)
        warm = {w.id for w in workers if job.model in w.warm_models}
        roomy = [
            c
            for c in eligible
            if c.has_room and c.worker_id in warm and c.finish_s <= best.finish_s * config.spill_within
        ]
        if roomy:
            best = min(roomy, key=lambda c: (c.finish_s, c.worker_id))
    if not best.has_room:
        return Placement(
            job.id,
            None,
            f"waits for {best.worker_id} ({best.finish_s:.2f}s, {best.note}): sooner than any free worker",
            candidates,
            reserved_on=best.worker_id,
        )
    return Placement(
        job.id, best.worker_id, f"earliest estimated finish ({best.finish_s:.2f}s, {best.note})", candidates
    )


def _nearest(
    job: JobView,
    workers: Sequence[WorkerView],
    near: Nearness,
    refused: Mapping[str, Candidate],
    fleet: Fleet,
    config: PlacementSettings,
) -> tuple[Candidate, ...]:
    """The candidates ``place`` decides from, scoring workers least loaded first
    (ties by id) and only those that could still be chosen. A job can finish on a
    worker no sooner than the work held there (a hot GPU only stretches it), plus,
    unless the worker holds a batch it may join, its own duration on the fastest
    worker. A worker whose bound passes the best finish found (or, while the best
    has no room, what a warm worker with room may cost instead: ``spill_within``
    times it) cannot be chosen, nor can one that would at most tie with a best
    that has room and loses the tie by id; once the held work alone passes, no
    worker further on can be. So a pass over a thousand GPUs scores the few near
    the front, not all of them. Refused workers keep their candidates (free: each
    model's are made once a pass)."""
    scored: dict[int, Candidate] = {}
    best: Candidate | None = None
    joinable = near.joinable.get(job.batch_key, set())
    own_s = fleet.durations.shape_seconds(job.shape, fleet.costs[job.model].step_s_512) / near.fastest

    def beyond(bound: float, worker_id: str) -> bool:
        if best is None:
            return False
        limit = best.finish_s if best.has_room else best.finish_s * max(config.spill_within, 1.0)
        return bound > limit or (best.has_room and bound == limit and worker_id > best.worker_id)

    for i in near.by_load:
        worker = workers[i]
        if beyond(worker.held_work_s, worker.id):
            break  # and every worker after it, more loaded (or as loaded, a greater id)
        if worker.id in refused or beyond(worker.held_work_s + (0.0 if i in joinable else own_s), worker.id):
            continue
        c = scored[i] = _score(job, worker, fleet, config)
        if c.eligible and (best is None or (c.finish_s, c.worker_id) < (best.finish_s, best.worker_id)):
            best = c
    return tuple(refused.get(w.id) or scored[i] for i, w in enumerate(workers) if w.id in refused or i in scored)


@dataclass
class Nearness:
    """What lets a pass score only the workers near the front for each job: the
    workers' indices by held work (then id), those holding a batch open for each
    batch key, and the fastest worker's speed. Kept up to date as the pass gives
    workers jobs."""

    workers: list[WorkerView]
    fastest: float
    by_load: list[int] = field(init=False)
    joinable: dict[BatchKey, set[int]] = field(init=False)
    _keys: list[tuple[float, str, int]] = field(init=False)

    def __post_init__(self) -> None:
        self._keys = sorted((w.held_work_s, w.id, i) for i, w in enumerate(self.workers))
        self.by_load = [i for _, _, i in self._keys]
        self.joinable = {}
        for i, w in enumerate(self.workers):
            self._open(i, w)

    def changed(self, i: int, before: WorkerView, after: WorkerView) -> None:
        at = bisect.bisect_left(self._keys, (before.held_work_s, before.id, i))
        del self._keys[at]
        del self.by_load[at]
        at = bisect.bisect_left(self._keys, (after.held_work_s, after.id, i))
        self._keys.insert(at, (after.held_work_s, after.id, i))
        self.by_load.insert(at, i)
        for key, _ in before.open_batches:
            self.joinable.get(key, set()).discard(i)
        self._open(i, after)

    def _open(self, i: int, w: WorkerView) -> None:
        for key, rows in w.open_batches:
            if rows:
                self.joinable.setdefault(key, set()).add(i)


def plan(
    jobs: Sequence[JobView],
    workers: Sequence[WorkerView],
    fleet: Fleet,
    config: PlacementSettings,
    *,
    now: float,
    exhaustive: Callable[[JobView], bool] = lambda job: False,
) -> list[Placement]:
    """Places queued jobs in priority order, each seeing the work (placed or
    reserved) of the ones before it. Each job is scored on the workers that could
    take it soonest (``_nearest``); one left waiting that ``exhaustive`` says may
    have running work suspended for it is scored on every worker, because
    preemption weighs them all."""
    ordered = order_queue([j for j in jobs], config, now=now)
    waiting = Counter(fleet.costs[j.model].capability for j in ordered if j.model in fleet.costs)
    wanted = Counter(j.model for j in ordered)
    busy = Counter(c for w in workers for c in w.held_capabilities)
    warm = Counter(m for w in workers for m in w.warm_models)
    planned = dict(Counter(m for w in workers if w.state == WorkerStatus.READY for m in w.planned_models))
    current = list(workers)  # as the pass changes them, in the workers' order
    index = {w.id: i for i, w in enumerate(current)}
    near = Nearness(current, max((fleet.durations.speed(w.id, w.speed) for w in workers), default=1.0))
    refusals = {m: Refusals.of(m, workers, fleet) for m in sorted({j.model for j in ordered}) if m in fleet.costs}
    placements = []
    for job in ordered:
        wanted[job.model] -= 1
        pass_fleet = replace(
            fleet, waiting=dict(waiting), busy=dict(busy), wanted=dict(wanted), warm=dict(warm), planned=planned
        )
        refused = refusals.get(job.model)
        placement = place(job, current, pass_fleet, config, refused, near)
        if placement.worker_id is None and exhaustive(job):
            placement = place(job, current, pass_fleet, config, refused)
        placements.append(placement)
        if placement.worker_id is None:
            wanted[job.model] += 1  # it still waits for its model
        target = placement.worker_id or placement.reserved_on
        if target is None:
            continue
        cost = fleet.costs[job.model]
        if placement.worker_id is not None:
            waiting[cost.capability] -= 1  # a reserving job still waits
        i = index[target]
        w = current[i]
        if cost.capability not in w.held_capabilities:
            busy[cost.capability] += 1
        after = _with_job(w, job, pass_fleet, config, placed=placement.worker_id is not None)
        warm.update(after.warm_models - w.warm_models)
        warm.subtract(w.warm_models - after.warm_models)
        current[i] = after
        near.changed(i, w, after)
    return placements


def _with_job(w: WorkerView, job: JobView, fleet: Fleet, config: PlacementSettings, *, placed: bool) -> WorkerView:
    cost = fleet.costs[job.model]
    joining = joining_seconds(job, w, fleet) if placed else None
    if joining is not None:
        rows = w.open_rows(job.batch_key) + job.num_images
        return replace(w, held_work_s=w.held_work_s + joining, open_batches=w.batches_with(job.batch_key, rows))
    added = job_seconds(job, w, fleet)
    warm, used = w.warm_models, w.vram_used_bytes
    if job.model not in warm:
        reload_s, evicted = eviction_cost(job.model, w, fleet, config, urgent=job.target_s is not None)
        added += cost.load_s + reload_s
        warm = (warm - set(evicted)) | {job.model}
        used = used - sum(fleet.costs[m].vram_bytes for m in evicted) + cost.vram_bytes
    return replace(
        w,
        # A reservation adds work but not a held job: the worker still has room
        # when it frees, and the reserving job is first in line for it.
        held_jobs=w.held_jobs + (1 if placed else 0),
        held_work_s=w.held_work_s + added,
        held_capabilities=w.held_capabilities | {cost.capability},
        warm_models=warm,
        vram_used_bytes=used,
        # A placed job opens a batch that later ones of its key may join.
        open_batches=w.batches_with(job.batch_key, job.num_images) if placed else w.open_batches,
    )
