"""What the scheduler's decisions say to people: a placement's routing, as stored
with the job and returned by ``GetJob``; recoveries in words; both counted."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler import policy
from scheduler.metrics import PLACEMENTS, QUEUE_WAIT
from scheduler.recovery import Fail, Recovery, Requeue
from services.db.records import JobSummary
from services.telemetry.metrics import ATTEMPTS_FAILED, JOBS_FINISHED, REQUEUES

# The candidates a job's routing keeps: the chosen worker, then the next best.
# (A fleet of a thousand GPUs would otherwise write a thousand with every job.)
ROUTING_CANDIDATES = 8


def routing_json(p: policy.Placement) -> dict[str, object]:
    chosen = (p.worker_id, p.reserved_on)
    ranked = sorted(p.candidates, key=lambda c: (c.worker_id not in chosen, not c.eligible, c.finish_s, c.worker_id))
    return {
        "worker_id": p.worker_id,
        "reason": p.reason,
        "candidates": [
            {
                "worker_id": c.worker_id,
                "eligible": c.eligible,
                "finish_s": c.finish_s if c.eligible else None,
                "note": c.note,
            }
            for c in ranked[:ROUTING_CANDIDATES]
        ],
    }


def placement_kind(p: policy.Placement) -> policy.PlacementKind:
    """What the chosen worker had to do to take the job."""
    chosen = next((c for c in p.candidates if c.worker_id == p.worker_id), None)
    return chosen.kind if chosen is not None and chosen.kind is not None else policy.PlacementKind.WARM


def count_placed(placements: Sequence[policy.Placement], jobs: Sequence[JobSummary]) -> None:
    placed = {p.job_id: p for p in placements if p.worker_id is not None}
    for job in jobs:
        p = placed.get(job.id)
        if p is not None:
            PLACEMENTS.labels(kind=placement_kind(p).value).inc()
        if job.attempt == 1 and job.scheduled_at is not None:
            QUEUE_WAIT.labels(lane=job.lane).observe((job.scheduled_at - job.created_at).total_seconds())


def count_recovered(action: Recovery) -> None:
    if isinstance(action, Requeue):
        REQUEUES.labels(cause=action.cause).inc()
        if action.failure is not None:
            ATTEMPTS_FAILED.labels(cause=action.cause).inc()
    elif isinstance(action, Fail):
        JOBS_FINISHED.labels(outcome="failed").inc()
        if action.failure is not None:
            ATTEMPTS_FAILED.labels(cause=action.cause).inc()
    else:
        JOBS_FINISHED.labels(outcome="expired").inc()


def describe(action: Recovery) -> str:
    if isinstance(action, Requeue):
        why = action.failure.describe() if action.failure else "handed back, no attempt counted"
        return f"{action.job_id}: requeued ({why})"
    if isinstance(action, Fail):
        return f"{action.job_id}: FAILED ({action.reason})"
    return f"{action.job_id}: EXPIRED (deadline passed while queued)"
