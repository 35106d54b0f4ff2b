"""Putting a held job back in the queue: shared by every path that does it (a dead
or restarted worker, a drain, a failed attempt). The caller holds the row locked."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Any

from services.db.models import JobRow
from services.db.records import AttemptFailure
from services.db.states import JobStatus


def requeue_row(row: JobRow, failure: AttemptFailure | None, *, now: datetime | Any) -> JobStatus:
    """QUEUED again, for another attempt; ``failure`` counts against the job's
    attempts, None (a hand-back, a job that never started) does not. A job whose
    cancel was requested ends CANCELLED instead of running again."""
    if failure is not None:
        row.failures += 1
        row.attempt_log = [*row.attempt_log, asdict(failure)]
    if row.cancel_requested:
        end_row(row, JobStatus.CANCELLED, "cancelled", now=now)
    else:
        row.status = JobStatus.QUEUED.value
        row.worker_id = None
        row.progress_step = 0
    return JobStatus(row.status)


def end_row(row: JobRow, status: JobStatus, error: str, *, now: datetime | Any) -> None:
    row.status = status.value
    row.error = error
    row.finished_at = now
