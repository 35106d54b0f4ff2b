"""A fleet snapshot's facts as the policy's views: what each job is, what each
worker holds and how long that will take, what runs where, and what the warm-set
planner is given. The one place facts meet the learned durations; the driver
(``scheduler.driver``) and the gateway's estimates build their views here."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from scheduler import policy
from scheduler.estimates import Shape
from scheduler.forecast import Submitted as SubmittedWork
from scheduler.preemption import RunningView
from scheduler.snapshot import FleetSnapshot, HeldWork, Holding, Progress, QueuedJob, Worker
from scheduler.warm_planner import GpuView
from services.config.placement import PlacementSettings
from services.db.counts import SubmittedCount
from services.generation import JoinKey


def job_view(job: QueuedJob, placement: PlacementSettings, costs: Mapping[str, policy.ModelCost]) -> policy.JobView:
    shape = job.shape
    cost = costs.get(shape.model)
    return policy.JobView(
        job.id,
        shape.model,
        shape.width,
        shape.height,
        shape.steps,
        shape.num_images,
        job.priority,
        job.queued_at,
        guidance_scale=shape.guidance_scale,
        failed_on=job.failed_on,
        target_s=placement.target_s(job.lane, cost.capability if cost is not None else ""),
        lane=job.lane,
        tenant=job.tenant,
        frames=shape.frames,
        adapters=job.adapters,
    )


class JobViews:
    """``job_view`` remembered per fact: a fact of a job stays the same while it
    waits, and a busy queue is viewed on every pass."""

    def __init__(self, placement: PlacementSettings, costs: Mapping[str, policy.ModelCost]) -> None:
        self.placement = placement
        self.costs = costs
        self._views: dict[QueuedJob, policy.JobView] = {}

    def __call__(self, job: QueuedJob) -> policy.JobView:
        view = self._views.get(job)
        if view is None:
            if len(self._views) > 100_000:
                self._views.clear()  # bounded: facts of jobs long gone go
            view = self._views[job] = job_view(job, self.placement, self.costs)
        return view


def remaining_s(seconds: float, progress: Progress) -> float:
    """What is left of work taking ``seconds`` in all, at ``progress``."""
    return max(seconds * (1.0 - progress.done) + progress.pending_s - progress.elapsed_s, 0.0)


def _batch_view(held: HeldWork) -> policy.JobView:
    """Held work as one job of its batch key (its largest)."""
    k = held.key
    return policy.JobView(
        "", k.model, k.width, k.height, k.steps, held.largest, guidance_scale=k.guidance_scale, frames=k.frames
    )


def _running_s(members: Sequence[HeldWork], worker: policy.WorkerView, fleet: policy.Fleet) -> float:
    """What is left of the batch that ``members`` (running work of one join key)
    run in on ``worker``. Jobs of other steps that joined it share its steps and
    leave as they finish: each stretch until the next leaves runs at the step
    time of the images still in it. Its members' progress is seen at one moment,
    so what else comes before its next step is the batch's, not each member's."""
    if len(members) == 1:
        [h] = members
        return remaining_s(policy.batch_seconds(_batch_view(h), h.images, worker, fleet), h.progress)
    job = _batch_view(members[0])
    by_end = sorted((h.key.steps * (1.0 - h.progress.done), h.images) for h in members)
    rows = sum(images for _, images in by_end)
    seconds, gone = 0.0, 0.0
    for left, images in by_end:
        seconds += (left - gone) * policy.step_seconds(job, rows, worker, fleet)
        gone, rows = left, rows - images
    pending = max(h.progress.pending_s for h in members)
    return max(seconds + pending - min(h.progress.elapsed_s for h in members), 0.0)


def worker_view(worker: Worker, held: Sequence[HeldWork], fleet: policy.Fleet) -> policy.WorkerView:
    """``worker`` with the work it holds, in the order given: what it runs (one
    batch per join key: ``_running_s``), then what waits there (loading a model
    it does not have before the first job that needs it); jobs of one key wait
    as batches still open to more, unless the batch it runs has a seat for
    them: sent to join it, they take the seat at its next step and add only
    what they cost it. Work it decodes holds its GPU no longer, but its model
    stays in use."""
    view = policy.WorkerView(
        id=worker.id,
        models=worker.models,
        warm_models=worker.warm_models,
        vram_total_bytes=worker.vram_total_bytes,
        vram_used_bytes=worker.vram_used_bytes,
        speed=worker.speed,
        temperature_c=worker.temperature_c,
        state=worker.state,
        planned_models=worker.planned_models,
        capabilities=worker.capabilities,
        open_seats=worker.open_seats,
        adapters=worker.adapters,
        adapter_load_s=worker.adapter_load_s or fleet.adapter_load_s,
        gpus=worker.gpus,
    )
    work, slots = worker.loading_s, 0
    running: dict[JoinKey, list[HeldWork]] = {}
    for h in held:
        if h.holding == Holding.RUNNING:
            running.setdefault(h.key.join_key, []).append(h)
    for members in running.values():
        work += _running_s(members, view, fleet)
        slots += 1
    warm, waiting = set(worker.warm_models), []
    for h in held:
        if h.holding == Holding.RESUMING:
            alone = policy.batch_seconds(_batch_view(h), h.images, view, fleet)
            work += alone * (1.0 - h.progress.done) + h.progress.pending_s
            slots += 1
        elif h.holding == Holding.WAITING:
            waiting.append(h)
        if h.key.model not in warm:
            work += fleet.costs[h.key.model].load_s
            warm.add(h.key.model)
    queued = []
    for h in waiting:
        seated = policy.seat_join(replace(_batch_view(h), num_images=h.images), view, fleet)
        if seated is not None:
            work += seated.growth_s
            view = replace(view, open_seats=view.seats_with(seated.seat, seated.seat.joined(h.images, h.key.steps)))
            continue
        batches, seconds = policy.queued_batches(_batch_view(h), h.images, view, fleet)
        work += seconds
        slots += batches
        queued.append(h)
    return replace(
        view,
        held_jobs=slots,
        held_work_s=work,
        held_capabilities=frozenset(fleet.costs[h.key.model].capability for h in held),
        open_batches=tuple(sorted((h.key, h.images) for h in queued)),
    )


def worker_views(snapshot: FleetSnapshot, fleet: policy.Fleet) -> list[policy.WorkerView]:
    by_worker: dict[str, list[HeldWork]] = {}
    for h in snapshot.held:
        if h.key.model in fleet.costs:
            by_worker.setdefault(h.worker_id, []).append(h)
    return [worker_view(w, by_worker.get(w.id, []), fleet) for w in snapshot.workers]


def running_views(
    snapshot: FleetSnapshot, fleet: policy.Fleet, placement: PlacementSettings | None = None
) -> list[RunningView]:
    """Running jobs as preemption sees them: a step of the batch each runs in and
    what is left of it, from the learned durations at its worker's speed. A job
    of a model with no cost has infinite estimates and capability "", and is
    never chosen to make room."""
    speeds = {w.id: (w.speed, w.gpus) for w in snapshot.workers}
    placement = placement or PlacementSettings()
    rows: dict[tuple[str, JoinKey], int] = {}  # a worker runs the jobs of one join key as one batch
    for job in snapshot.running:
        key = (job.worker_id, job.shape.join_key)
        rows[key] = rows.get(key, 0) + job.shape.num_images
    views = []
    for job in snapshot.running:
        shape = job.shape
        cost = fleet.costs.get(shape.model)
        step_s = left_s = math.inf
        if cost is not None and shape.steps > 0:
            batch = rows[(job.worker_id, shape.join_key)]
            view = policy.JobView(job.id, shape.model, shape.width, shape.height, shape.steps, batch)
            speed, gpus = speeds.get(job.worker_id, (1.0, 1))
            worker = policy.WorkerView(job.worker_id, frozenset(), frozenset(), 0, 0, speed=speed, gpus=gpus)
            seconds = policy.job_seconds(view, worker, fleet)
            step_s, left_s = seconds / shape.steps, remaining_s(seconds, job.progress)
        capability = cost.capability if cost is not None else ""
        views.append(
            RunningView(
                job_id=job.id,
                attempt=job.attempt,
                worker_id=job.worker_id,
                lane=job.lane,
                capability=capability,
                model=shape.model,
                preemptions=job.preemptions,
                suspend_requested=job.suspend_requested,
                step_s=step_s,
                remaining_s=left_s,
                target_s=placement.target_s(job.lane, capability),
            )
        )
    return views


def gpu_views(snapshot: FleetSnapshot, fleet: policy.Fleet) -> list[GpuView]:
    return [
        GpuView(
            id=w.id,
            models=w.models,
            warm_models=w.warm_models,
            vram_total_bytes=w.vram_total_bytes,
            speed=fleet.durations.speed(w.id, w.speed),
            state=w.state,
            primary=w.primary_model,
        )
        for w in snapshot.workers
    ]


def submitted_work(s: SubmittedCount, fleet: policy.Fleet, placement: PlacementSettings) -> SubmittedWork:
    """Jobs submitted of one shape and lane as the forecast takes them: their
    speed-1.0 seconds, and their latency class."""
    cost = fleet.costs[s.model]
    seconds = s.count * fleet.durations.shape_seconds(
        Shape(s.model, s.width * s.height * s.frames, s.steps, s.num_images), cost.step_s_512
    )
    bound = placement.plans_as_latency_bound(placement.target_s(s.lane, cost.capability))
    return SubmittedWork(s.model, seconds, s.newer, bound, s.backlog)
