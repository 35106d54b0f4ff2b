"""How a simulated GPU runs a batch, apart from the event loop that times it
(``engine``): the models it evicts to make room for the batch's, the queued jobs
that ride with the head job, how long the batch computes, and the step boundary
a suspended batch stops at."""

from __future__ import annotations

import math
from collections.abc import Mapping

from scheduler.simulator.scenario import SimModel
from scheduler.simulator.world import Gpu, Job


def make_room(gpu: Gpu, model: str, vram_gb: Mapping[str, float], models: Mapping[str, SimModel]) -> None:
    """Evicts from ``gpu``, by (planned, eviction priority, least recently used),
    until ``model`` fits."""
    need = vram_gb[model]
    while gpu.loaded and sum(vram_gb[m] for m in gpu.loaded) + need > gpu.spec.vram_gb:
        victim = min(gpu.loaded, key=lambda m: (m in gpu.planned, models[m].eviction_priority, gpu.loaded[m]))
        del gpu.loaded[victim]


def take_riders(gpu: Gpu, job: Job, max_batch: int) -> tuple[list[Job], int]:
    """The later jobs of ``job``'s type on ``gpu``'s queue that run in its batch
    (taken off the queue) while its images stay within ``max_batch``, and the
    batch's images."""
    riders, images = [], job.trace.type.batch
    # A resumed job runs alone: its batch-mates would be at other steps.
    for other in list(gpu.queue) if not job.done else ():
        if other.trace.type == job.trace.type and not other.done and images + other.trace.type.batch <= max_batch:
            gpu.queue.remove(other)
            riders.append(other)
            images += other.trace.type.batch
    return riders, images


def compute_s(job: Job, riders: list[Job], model: SimModel, images: int, speed: float) -> float:
    """How long the batch of ``job`` and ``riders`` computes at ``speed``, timed by
    the model's batch-efficiency curve; a resumed job only its remaining steps."""
    per_image = sum(m.trace.work_s / m.trace.type.batch for m in (job, *riders)) / (1 + len(riders))
    run = per_image * model.batch_factor(images) / speed
    if job.done:
        run *= 1.0 - job.done
    return run


def stop_boundary(gpu: Gpu, now: float) -> tuple[int, float] | None:
    """Where the batch running on ``gpu``, asked at ``now`` to suspend, stops: the
    steps of this run done at its next step boundary (0: as soon as its model is
    loaded and its checkpoint read, before its first step) and when that is;
    None when that boundary is its last step (it just finishes)."""
    head = gpu.batch[0]
    steps_left = head.trace.type.steps * (1.0 - head.resumed_from)
    compute_start = gpu.running_since + gpu.run_load_s + gpu.run_resume_s
    step_s = (gpu.run_s - gpu.run_load_s - gpu.run_resume_s) / steps_left
    steps = math.ceil(max(now - compute_start, 0.0) / step_s - 1e-9)
    if steps >= steps_left - 1e-6:
        return None
    return steps, compute_start + steps * step_s
