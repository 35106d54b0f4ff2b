"""Registry entries and database records as the policy's frozen views.
Shared by the scheduler, which places jobs and plans warm sets, and the gateway,
which estimates when a job will run."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from scheduler import policy
from scheduler.estimates import Durations, Learned, Shape, learn
from scheduler.preemption import RunningView, running_estimates
from scheduler.warm_planner import GpuView
from services.config.placement import PlacementSettings
from services.db.records import (
    Estimate,
    Fold,
    HeldGroup,
    JobRecord,
    JobSummary,
    RunningJob,
    RunTime,
    WorkerRecord,
)
from services.db.states import JobStatus
from services.models.registry import ModelRegistry


def costs_from(registry: ModelRegistry) -> dict[str, policy.ModelCost]:
    return {
        name: policy.ModelCost(
            capability=spec.capability,
            step_s_512=spec.step_s_512,
            load_s=spec.load_seconds,
            vram_bytes=spec.vram_bytes,
            eviction_priority=spec.eviction_priority,
            max_batch=spec.max_batch,
        )
        for name, spec in registry.models.items()
    }


def measured_costs(
    costs: Mapping[str, policy.ModelCost], workers: Sequence[WorkerRecord]
) -> dict[str, policy.ModelCost]:
    """The registry's costs, corrected by what samplers measured and heartbeat
    (``telemetry["models"]``): the median load time, and the largest footprint
    when it is bigger than the registry says."""
    loads: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    for w in workers:
        reported = w.telemetry.get("models")
        for name, measured in reported.items() if isinstance(reported, dict) else ():
            if name in costs and isinstance(measured, dict):
                loads.setdefault(name, []).append(float(measured.get("load_s", 0.0)))
                sizes[name] = max(sizes.get(name, 0), int(measured.get("bytes", 0)))
    corrected = dict(costs)
    for name, seen in loads.items():
        cost = costs[name]
        corrected[name] = replace(
            cost, load_s=statistics.median(seen), vram_bytes=max(cost.vram_bytes, sizes.get(name, 0))
        )
    return corrected


def fold_run_times(costs: Mapping[str, policy.ModelCost]) -> Fold:
    """Learning from workers' run times, as the repository's learning pass wants it."""
    step_s = {model: cost.step_s_512 for model, cost in costs.items()}

    def fold(
        shapes: dict[str, Estimate], speeds: dict[str, Estimate], facts: Sequence[RunTime]
    ) -> tuple[dict[str, Estimate], dict[str, Estimate]]:
        observations = [(Shape(f.model, f.pixels, f.steps, f.batch), f.worker_id, f.seconds) for f in facts]
        learned = learn(durations_from(shapes, speeds), observations, step_s)
        return (
            {k: (v.mean, v.count) for k, v in learned.shapes.items()},
            {k: (v.mean, v.count) for k, v in learned.speeds.items()},
        )

    return fold


def durations_from(shapes: Mapping[str, Estimate], speeds: Mapping[str, Estimate]) -> Durations:
    return Durations(
        shapes={k: Learned(mean, count) for k, (mean, count) in shapes.items()},
        speeds={k: Learned(mean, count) for k, (mean, count) in speeds.items()},
    )


def job_view(
    job: JobRecord | JobSummary, config: PlacementSettings, costs: Mapping[str, policy.ModelCost]
) -> policy.JobView:
    # A preempted job ages from its suspension (``aged_from``): back in the queue
    # with its old age, it would outrank the job it was suspended for at once.
    cost = costs.get(job.model)
    return policy.JobView(
        job.id,
        job.model,
        job.width,
        job.height,
        job.steps,
        job.num_images,
        job.priority,
        (job.aged_from or job.created_at).timestamp(),
        guidance_scale=job.guidance_scale,
        failed_on=frozenset(f.worker_id for f in job.attempt_log),
        target_s=config.target_s(job.lane, cost.capability if cost is not None else ""),
    )


def running_views(
    jobs: Sequence[RunningJob],
    workers: Sequence[WorkerRecord] | Sequence[policy.WorkerView],
    fleet: policy.Fleet,
    config: PlacementSettings | None = None,
) -> list[RunningView]:
    """Running jobs as preemption sees them: each one's step and what is left of
    it on its worker, from the learned durations at that worker's speed. Jobs of
    one shape running on one worker are estimated as the batch they run in, as
    the simulator does. A job of a model with no cost has infinite estimates and
    capability "", and is never chosen to make room."""
    speeds = {w.id: w.speed for w in workers}
    config = config or PlacementSettings()
    # Jobs of one shape running on one worker run as one batch.
    rows: dict[tuple[str, str, int, int, int], int] = {}
    for job in jobs:
        key = (job.worker_id, job.model, job.width, job.height, job.steps)
        rows[key] = rows.get(key, 0) + job.num_images
    views = []
    for job in jobs:
        cost = fleet.costs.get(job.model)
        batch = rows[(job.worker_id, job.model, job.width, job.height, job.steps)]
        shape = policy.JobView(job.id, job.model, job.width, job.height, job.steps, batch, job.priority)
        worker = policy.WorkerView(job.worker_id, frozenset(), frozenset(), 0, 0, speed=speeds.get(job.worker_id, 1.0))
        step_s, remaining_s = running_estimates(shape, worker, fleet, steps_done=job.progress_step)
        views.append(
            RunningView(
                job_id=job.id,
                attempt=job.attempt,
                worker_id=job.worker_id,
                lane=job.lane,
                capability=cost.capability if cost is not None else "",
                model=job.model,
                preemptions=job.preemptions,
                suspend_requested=job.suspend_requested,
                step_s=step_s,
                remaining_s=remaining_s,
                target_s=config.target_s(job.lane, cost.capability if cost else ""),
            )
        )
    return views


def group_view(group: HeldGroup) -> policy.JobView:
    """A held group as one job of its batch key (its largest)."""
    return policy.JobView(
        "", group.model, group.width, group.height, group.steps, group.largest, guidance_scale=group.guidance_scale
    )


def worker_views(
    workers: Sequence[WorkerRecord], held: Sequence[HeldGroup], fleet: policy.Fleet
) -> list[policy.WorkerView]:
    """Each worker with what it holds as batches: the ones running (started jobs
    of one key), and the ones it has not started, still open to more jobs."""
    by_worker: dict[str, list[HeldGroup]] = {}
    for g in held:
        if g.model in fleet.costs:
            by_worker.setdefault(g.worker_id, []).append(g)
    views = []
    for w in workers:
        view = policy.WorkerView(
            id=w.id,
            models=frozenset(w.models),
            warm_models=frozenset(w.warm_models),
            vram_total_bytes=w.vram_total_bytes,
            vram_used_bytes=w.vram_used_bytes,
            speed=w.speed,
            temperature_c=w.temperature_c,
            state=w.status.value,
            planned_models=frozenset(w.planned_models),
        )
        mine = by_worker.get(w.id, [])
        # Decoding frees the GPU: those jobs hold no work here.
        running = [g for g in mine if g.status == JobStatus.RUNNING]
        waiting = [g for g in mine if g.status == JobStatus.SCHEDULED]
        work, slots = 0.0, len(running)
        for g in running:
            work += policy.batch_seconds(group_view(g), g.images, view, fleet) * (1.0 - g.done)
        for g in waiting:
            batches, seconds = policy.queued_batches(group_view(g), g.images, view, fleet)
            work += seconds
            slots += batches
        work += sum(fleet.costs[m].load_s for m in {g.model for g in mine} - set(w.warm_models))
        views.append(
            replace(
                view,
                held_jobs=slots,
                held_work_s=work,
                held_capabilities=frozenset(fleet.costs[g.model].capability for g in mine),
                open_batches=tuple(sorted((group_view(g).batch_key, g.images) for g in waiting)),
            )
        )
    return views


def gpu_views(workers: Sequence[WorkerRecord], durations: Durations) -> list[GpuView]:
    return [
        GpuView(
            id=w.id,
            models=frozenset(w.models),
            warm_models=frozenset(w.warm_models),
            vram_total_bytes=w.vram_total_bytes,
            speed=durations.speed(w.id, w.speed),
            state=w.status.value,
            primary=w.primary_model,
        )
        for w in workers
    ]
