"""Estimated wait and backpressure for a job being submitted.

The gateway asks how long a new job would wait: the work already held by the
workers that can run it plus the work queued ahead of it, spread over their
measured speeds (never less than the time until the first of them frees), and a
model load when none has it warm. If that passes its lane's limit the submit is
refused with the estimate as the retry delay, instead of queuing silently.

Pure, like placement: the same estimates, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.policy import Fleet, JobView, WorkerView, job_seconds, worker_speed
from services.config.placement import PlacementSettings
from services.db.states import WorkerStatus


@dataclass(frozen=True)
class Estimate:
    wait_s: float  # until it starts
    run_s: float  # from start to done


@dataclass(frozen=True)
class Refusal:
    lane: str
    wait_s: float
    limit_s: float


def _capable(job: JobView, w: WorkerView, fleet: Fleet) -> bool:
    cost = fleet.costs[job.model]
    if w.state != WorkerStatus.READY or job.model not in w.models:
        return False
    return not w.vram_total_bytes or cost.vram_bytes <= w.vram_total_bytes


def estimate(
    job: JobView, ahead: Sequence[tuple[JobView, int]], workers: Sequence[WorkerView], fleet: Fleet
) -> Estimate | None:
    """None when no live worker can run the job (nothing to estimate from yet).
    ``ahead`` is each kind of queued job that runs before this one, with its count."""
    if job.model not in fleet.costs:
        return None
    capable = [w for w in workers if _capable(job, w, fleet)]
    if not capable:
        return None
    speeds = {w.id: worker_speed(job, w, fleet) for w in capable}
    rate = sum(speeds.values())
    held_at_1 = sum(w.held_work_s * speeds[w.id] for w in capable)
    queued_at_1 = 0.0
    for other, count in ahead:
        cost = fleet.costs.get(other.model)
        if cost is None or not any(other.model in w.models for w in capable):
            continue
        queued_at_1 += count * fleet.durations.shape_seconds(other.shape, cost.step_s_512)
    wait = max(min(w.held_work_s for w in capable), (held_at_1 + queued_at_1) / rate)
    if not any(job.model in w.warm_models for w in capable):
        wait += fleet.costs[job.model].load_s
    fastest = max(capable, key=lambda w: speeds[w.id])
    return Estimate(wait, job_seconds(job, fastest, fleet))


def admit(lane_name: str, wait: Estimate | None, config: PlacementSettings) -> Refusal | None:
    lane = config.lane(lane_name)
    if lane is None or wait is None or wait.wait_s <= lane.max_wait_s:
        return None
    return Refusal(lane.name, wait.wait_s, lane.max_wait_s)
