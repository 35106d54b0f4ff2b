"""Placement policy: pure functions over frozen snapshots, the clock passed in.

A job goes to the worker where it is estimated to *finish* soonest: the work
already held there, plus loading the model if it is not warm, plus its own
duration at that worker's speed. Workers that cannot serve the model, cannot fit
it, or already hold a full backlog are not candidates (late binding: the job then
waits centrally and goes to whichever worker frees first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

REFERENCE_PIXELS = 512 * 512


@dataclass(frozen=True)
class ModelCost:
    step_s_512: float  # one denoising step of one image at 512x512 on a speed-1.0 worker
    load_s: float
    vram_bytes: int


@dataclass(frozen=True)
class JobView:
    id: str
    model: str
    width: int
    height: int
    steps: int
    num_images: int


@dataclass(frozen=True)
class WorkerView:
    id: str
    models: frozenset[str]  # models it can serve
    warm_models: frozenset[str]
    vram_total_bytes: int  # 0: unknown (a CPU worker), treated as unlimited
    vram_used_bytes: int
    speed: float  # relative to the reference GPU
    held_jobs: int  # jobs scheduled to it and not finished
    held_work_s: float  # estimated seconds of work those jobs need


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    eligible: bool
    finish_s: float  # estimated seconds from now until the job would be done there
    note: str


@dataclass(frozen=True)
class Placement:
    job_id: str
    worker_id: str | None  # None: no worker can take it now; it stays queued
    reason: str
    candidates: tuple[Candidate, ...]


def run_seconds(job: JobView, cost: ModelCost, speed: float) -> float:
    pixels = job.width * job.height / REFERENCE_PIXELS
    return cost.step_s_512 * job.steps * pixels * job.num_images / max(speed, 1e-6)


def score(job: JobView, worker: WorkerView, cost: ModelCost, *, backlog_limit: int) -> Candidate:
    if job.model not in worker.models:
        return Candidate(worker.id, False, float("inf"), "cannot serve the model")
    warm = job.model in worker.warm_models
    if not warm and worker.vram_total_bytes and cost.vram_bytes > worker.vram_total_bytes:
        return Candidate(worker.id, False, float("inf"), "model does not fit in its memory")
    if worker.held_jobs > backlog_limit:
        return Candidate(worker.id, False, float("inf"), f"backlog full ({worker.held_jobs} jobs)")
    finish = worker.held_work_s + run_seconds(job, cost, worker.speed)
    note = "warm"
    if not warm:
        finish += cost.load_s
        note = f"cold (+{cost.load_s:.1f}s load)"
        free = worker.vram_total_bytes - worker.vram_used_bytes
        if worker.vram_total_bytes and cost.vram_bytes > free:
            # Something must be evicted first; its reload later is a cost too.
            finish += cost.load_s
            note += ", evicts"
    return Candidate(worker.id, True, finish, note)


def place(
    job: JobView,
    workers: Sequence[WorkerView],
    costs: Mapping[str, ModelCost],
    *,
    now: datetime,
    backlog_limit: int,
) -> Placement:
    cost = costs.get(job.model)
    if cost is None:
        return Placement(job.id, None, f"unknown model {job.model!r}", ())
    candidates = tuple(score(job, w, cost, backlog_limit=backlog_limit) for w in workers)
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        reason = (
            "no live worker serves the model"
            if not any(job.model in w.models for w in workers)
            else "every worker that can run it is busy"
        )
        return Placement(job.id, None, reason, candidates)
    best = min(eligible, key=lambda c: (c.finish_s, c.worker_id))
    return Placement(
        job.id, best.worker_id, f"earliest estimated finish ({best.finish_s:.2f}s, {best.note})", candidates
    )


def plan(
    jobs: Sequence[JobView],
    workers: Sequence[WorkerView],
    costs: Mapping[str, ModelCost],
    *,
    now: datetime,
    backlog_limit: int,
) -> list[Placement]:
    """Places jobs in the order given (highest priority first), each seeing the
    work the earlier ones added."""
    fleet = {w.id: w for w in workers}
    placements = []
    for job in jobs:
        placement = place(job, list(fleet.values()), costs, now=now, backlog_limit=backlog_limit)
        placements.append(placement)
        if placement.worker_id is not None:
            w = fleet[placement.worker_id]
            cost = costs[job.model]
            added = run_seconds(job, cost, w.speed) + (0.0 if job.model in w.warm_models else cost.load_s)
            fleet[w.id] = replace(
                w,
                held_jobs=w.held_jobs + 1,
                held_work_s=w.held_work_s + added,
                warm_models=w.warm_models | {job.model},
                vram_used_bytes=w.vram_used_bytes + (0 if job.model in w.warm_models else cost.vram_bytes),
            )
    return placements
