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

Open seats: a job of the join key (model and size) of a batch a worker runs now,
where its heartbeat says that batch has room, joins it at its next step
(``services.seats``): it finishes after its own steps at the bigger batch's step
time, waiting for nothing held there, and the worker's held work grows by what the
bigger step costs the other members. The pass uses the seat up, so no two jobs
count on its last room.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from scheduler.nearness import Nearness, nearest
from scheduler.policy import (
    Candidate,
    Fleet,
    JobView,
    Placement,
    WorkerView,
    job_seconds,
    joining_seconds,
    order_queue,
    seat_join,
)
from scheduler.scoring import admitted, eviction_cost, refusal
from services.config.placement import PlacementSettings
from services.db.states import WorkerStatus


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
        cost = fleet.costs[model]
        refused = {w.id: c for w in workers if (c := refusal(model, w, fleet)) is not None}
        # A group keeps its devices for the models it spans while a single worker serves
        # this one: run alone on its leader, one job would hold every device of the group.
        if any(w.gpus == 1 and model in w.models for w in workers):
            for w in workers:
                if w.gpus > 1 and not w.spans(cost) and w.id not in refused:
                    refused[w.id] = Candidate(w.id, False, math.inf, "a group: single workers serve the model")
        served = any(w.serves(cost.capability) for w in workers)
        return cls(refused, served, any(model in w.models for w in workers))


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
        candidates = nearest(job, workers, near, refused, fleet, config)
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
    reserved) of the ones before it. Each job is scored on the workers that
    could take it soonest (``scheduler.nearness``); one left waiting that
    ``exhaustive`` says may have running work suspended for it is scored on
    every worker, because preemption weighs them all."""
    ordered = order_queue([j for j in jobs], config, now=now)
    waiting = Counter(fleet.costs[j.model].capability for j in ordered if j.model in fleet.costs)
    wanted = Counter(j.model for j in ordered)
    # A cap counts GPUs: a group holding a capability's work holds each of its devices.
    busy: Counter[str] = Counter()
    for w in workers:
        busy.update(dict.fromkeys(w.held_capabilities, w.gpus))
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
            busy[cost.capability] += w.gpus
        after = _with_job(w, job, pass_fleet, config, placed=placement.worker_id is not None)
        warm.update(after.warm_models - w.warm_models)
        warm.subtract(w.warm_models - after.warm_models)
        current[i] = after
        near.changed(i, w, after)
    return placements


def _with_job(w: WorkerView, job: JobView, fleet: Fleet, config: PlacementSettings, *, placed: bool) -> WorkerView:
    """``w`` once it holds ``job``: its work grown by the job's, its adapters then resident."""
    after = _with_job_work(w, job, fleet, config, placed=placed)
    if not job.adapters:
        return after
    return replace(after, held_work_s=after.held_work_s + w.adapter_seconds(job), adapters=w.adapters | job.adapters)


def _with_job_work(w: WorkerView, job: JobView, fleet: Fleet, config: PlacementSettings, *, placed: bool) -> WorkerView:
    cost = fleet.costs[job.model]
    seated = seat_join(job, w, fleet) if placed else None
    if seated is not None:
        seat = seated.seat.joined(job.num_images, job.steps)
        return replace(w, held_work_s=w.held_work_s + seated.growth_s, open_seats=w.seats_with(seated.seat, seat))
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
