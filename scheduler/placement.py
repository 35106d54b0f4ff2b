"""Placement: pure functions over the policy's views, the clock passed in; ``plan``
is what the driver calls.

A job goes to the worker where it is estimated to *finish* soonest, as
``scheduler.scoring`` estimates it on each worker (and says why a worker is no
candidate).

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
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.policy import (
    Candidate,
    Fleet,
    JobView,
    Placement,
    WorkerView,
    job_seconds,
    joining_seconds,
    order_queue,
)
from scheduler.scoring import admitted, eviction_cost, refusal
from services.config.placement import PlacementSettings
from services.db.states import WorkerStatus
from services.generation import BatchKey


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
        candidates = tuple(refused.get(w.id) or admitted(job, w, fleet, config) for w in workers)
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
        c = scored[i] = admitted(job, worker, fleet, config)
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
