"""Putting held jobs back in the queue, and ending jobs: the SQL shared by every
path that does it (a dead or restarted worker, a drain, a failed attempt, the
recovery pass)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.records import AttemptFailure
from services.db.repository.database import fetch_all
from services.db.states import JobStatus

# QUEUED again for another attempt, or CANCELLED if its cancel was requested. A
# failure counts against the job's attempts and joins its log; NULL (a hand-back, a
# job that never started) costs nothing. ``guard`` narrows which rows may change.
_REQUEUE = """
UPDATE jobs AS j SET
    failures = j.failures + (r.failure IS NOT NULL)::int,
    attempt_log = CASE WHEN r.failure IS NULL THEN j.attempt_log
                       ELSE j.attempt_log || jsonb_build_array(r.failure::jsonb) END,
    status = CASE WHEN j.cancel_requested THEN 'CANCELLED' ELSE 'QUEUED' END,
    error = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE j.error END,
    finished_at = CASE WHEN j.cancel_requested THEN %(now)s ELSE j.finished_at END,
    worker_id = CASE WHEN j.cancel_requested THEN j.worker_id ELSE NULL END,
    -- The next attempt resumes from the job's checkpoint, if it has one.
    progress_step = CASE WHEN j.cancel_requested THEN j.progress_step ELSE j.checkpoint_step END,
    suspend_requested = false,
    -- The next attempt's stages are its own.
    dispatched_at = CASE WHEN j.cancel_requested THEN j.dispatched_at ELSE NULL END,
    decoding_at = CASE WHEN j.cancel_requested THEN j.decoding_at ELSE NULL END,
    decoded_at = CASE WHEN j.cancel_requested THEN j.decoded_at ELSE NULL END
FROM unnest(%(ids)s::varchar[], %(attempts)s::int[], %(failures)s::text[]) AS r(id, attempt, failure)
WHERE j.id = r.id AND j.attempt = r.attempt AND ({guard})
RETURNING j.id, j.status
"""

# Ends a job in a terminal state; a failure, if any, joins its log.
_END = """
UPDATE jobs AS j SET
    status = %(status)s,
    error = %(error)s,
    finished_at = %(now)s,
    suspend_requested = false,
    failures = j.failures + (%(failure)s::text IS NOT NULL)::int,
    attempt_log = CASE WHEN %(failure)s::text IS NULL THEN j.attempt_log
                       ELSE j.attempt_log || jsonb_build_array(%(failure)s::jsonb) END
WHERE j.id = %(id)s AND j.attempt = %(attempt)s AND ({guard})
RETURNING j.id
"""


def failure_json(failure: AttemptFailure | None) -> str | None:
    return json.dumps(asdict(failure)) if failure is not None else None


async def requeue(
    conn: AsyncConnection[DictRow],
    jobs: Sequence[tuple[str, int, AttemptFailure | None]],
    *,
    now: datetime,
    guard: str = "TRUE",
    params: Mapping[str, object] | None = None,
) -> dict[str, JobStatus]:
    """(job id, attempt, failure) back to the queue where ``guard`` holds (SQL over
    ``j``, with ``params``); returns each changed job's new status."""
    if not jobs:
        return {}
    rows = await fetch_all(
        conn,
        _REQUEUE.format(guard=guard),
        {
            **(params or {}),
            "now": now,
            "ids": [job_id for job_id, _, _ in jobs],
            "attempts": [attempt for _, attempt, _ in jobs],
            "failures": [failure_json(f) for _, _, f in jobs],
        },
    )
    return {row["id"]: JobStatus(row["status"]) for row in rows}


async def end(
    conn: AsyncConnection[DictRow],
    job_id: str,
    attempt: int,
    status: JobStatus,
    error: str,
    *,
    now: datetime,
    failure: AttemptFailure | None = None,
    guard: str = "TRUE",
    params: Mapping[str, object] | None = None,
) -> bool:
    """Ends the job's ``attempt`` in ``status`` where ``guard`` holds; whether it did."""
    rows = await fetch_all(
        conn,
        _END.format(guard=guard),
        {
            **(params or {}),
            "id": job_id,
            "attempt": attempt,
            "status": status.value,
            "error": error,
            "now": now,
            "failure": failure_json(failure),
        },
    )
    return bool(rows)


async def charge(conn: AsyncConnection[DictRow], job_id: str, gpu_seconds: float) -> None:
    """Adds an attempt's sampling time to what the job is charged."""
    if gpu_seconds > 0:
        await conn.execute("UPDATE jobs SET gpu_seconds = gpu_seconds + %s WHERE id = %s", (gpu_seconds, job_id))


def qualified(fields: Sequence[str], alias: str) -> str:
    """``alias.a, alias.b, ...``: a column list for a statement that joins."""
    return ", ".join(f"{alias}.{name}" for name in fields)
