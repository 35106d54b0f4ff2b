"""Denoising checkpoints and suspensions.

A job's latest checkpoint lives in ``job_checkpoints`` beside the job, and the job
row names the attempt that wrote it and its step. Every write is fenced like the
worker's other writes: only the attempt now current on its worker may store a
checkpoint, and within an attempt a checkpoint never replaces a later one (periodic
writes may land out of order). A resumed attempt reads only the checkpoint the job
row names, so a stale attempt's state is never used.

Suspending is a hand-back with a checkpoint: the state is stored and the job goes
back to the queue in one transaction, with no attempt counted, and the suspension
joins the job's ``suspend_log`` (so does each resumption, when an attempt starts
from a checkpoint). The scheduler asks for a suspension by setting
``suspend_requested``; the worker hears it by RPC, or at its next progress write."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.records import SUSPENDED, JobRecord, RunningJobRecord, StoredCheckpoint
from services.db.repository.database import Area, fetch_all
from services.db.repository.requeue import requeue
from services.db.states import HELD, TERMINAL, JobStatus

_HELD = [st.value for st in HELD]
# The attempt is current on this worker and still sampling.
_SAMPLING = "j.worker_id = %(worker)s AND j.status = 'RUNNING'"

_SAVE = f"""
WITH recorded AS (
    UPDATE jobs AS j SET checkpoint_step = %(step)s, checkpoint_attempt = %(attempt)s
    WHERE j.id = %(id)s AND j.attempt = %(attempt)s AND {_SAMPLING}
      AND NOT (j.checkpoint_attempt IS NOT DISTINCT FROM %(attempt)s AND j.checkpoint_step >= %(step)s)
    RETURNING j.id
)
INSERT INTO job_checkpoints (job_id, attempt, step, total, data, created_at)
SELECT id, %(attempt)s, %(step)s, %(total)s, %(data)s, %(now)s FROM recorded
ON CONFLICT (job_id) DO UPDATE SET
    attempt = EXCLUDED.attempt, step = EXCLUDED.step, total = EXCLUDED.total,
    data = EXCLUDED.data, created_at = EXCLUDED.created_at
RETURNING job_id
"""

_RUNNING = """
SELECT id, attempt, worker_id, lane, priority, model, width, height, steps, guidance_scale, num_images, frames,
       progress_step, preemptions, suspend_requested, started_at
FROM jobs WHERE status = 'RUNNING' AND worker_id IS NOT NULL
ORDER BY id
"""


class Checkpoints(Area):
    async def save(
        self, job_id: str, attempt: int, worker_id: str, *, step: int, total: int, data: bytes, now: datetime
    ) -> bool:
        """Stores a running attempt's checkpoint; False if the attempt is no longer
        current here, or a later checkpoint of it is stored already."""
        async with self.db.connection() as conn:
            return await _save(conn, job_id, attempt, worker_id, step=step, total=total, data=data, now=now)

    async def load(self, jobs: Sequence[JobRecord]) -> dict[str, StoredCheckpoint]:
        """The checkpoint each job's row names, by job id; a job without one, or
        whose stored checkpoint is not the one its row names, is left out."""
        named = [j for j in jobs if j.checkpoint_step > 0 and j.checkpoint_attempt is not None]
        if not named:
            return {}
        rows = await self.db.all(
            """
            SELECT c.job_id, c.attempt, c.step, c.total, c.data
            FROM job_checkpoints c
            JOIN unnest(%(ids)s::varchar[], %(attempts)s::int[], %(steps)s::int[]) AS n(id, attempt, step)
              ON c.job_id = n.id AND c.attempt = n.attempt AND c.step = n.step
            """,
            {
                "ids": [j.id for j in named],
                "attempts": [j.checkpoint_attempt for j in named],
                "steps": [j.checkpoint_step for j in named],
            },
        )
        return {
            r["job_id"]: StoredCheckpoint(r["job_id"], r["attempt"], r["step"], r["total"], bytes(r["data"]))
            for r in rows
        }

    async def suspend(
        self,
        job_id: str,
        attempt: int,
        worker_id: str,
        *,
        step: int,
        total: int,
        data: bytes | None,
        reason: str,
        preempted: bool,
        now: datetime,
        gpu_seconds: float = 0.0,
    ) -> JobStatus | None:
        """Stores the checkpoint (``data`` None: the job's stored one stays) and puts
        the job back in the queue, no attempt counted but the ``gpu_seconds`` it
        sampled charged (its next attempt goes on from them), in one transaction; returns
        its new status (QUEUED, or CANCELLED if its cancel was requested), or None
        if the attempt is no longer current here."""
        async with self.db.tx() as conn:
            if data is not None and step > 0:
                await _save(conn, job_id, attempt, worker_id, step=step, total=total, data=data, now=now)
            changed = await requeue(
                conn,
                [(job_id, attempt, None)],
                now=now,
                guard="j.worker_id = %(worker)s AND j.status = ANY(%(statuses)s)",
                params={"worker": worker_id, "statuses": _HELD},
            )
            status = changed.get(job_id)
            if status == JobStatus.QUEUED:
                entry = {
                    "kind": SUSPENDED,
                    "attempt": attempt,
                    "worker_id": worker_id,
                    "step": step,
                    "total": total,
                    "at": now.isoformat(),
                    "reason": reason,
                }
                await conn.execute(
                    """
                    UPDATE jobs SET suspend_log = suspend_log || jsonb_build_array(%(entry)s::jsonb),
                                    preemptions = preemptions + %(preempted)s::int,
                                    gpu_seconds = gpu_seconds + %(gpu_seconds)s,
                                    aged_from = CASE WHEN %(preempted)s THEN %(now)s ELSE aged_from END
                    WHERE id = %(id)s
                    """,
                    {
                        "id": job_id,
                        "entry": json.dumps(entry),
                        "preempted": preempted,
                        "now": now,
                        "gpu_seconds": gpu_seconds,
                    },
                )
            return status

    async def request_suspend(self, job_id: str, attempt: int, *, max_preemptions: int, reason: str = "") -> str | None:
        """Asks for a running attempt to be suspended for other work (``reason``:
        why, as its suspension will say); returns the address of the worker that
        runs it, or None if the job is no longer running that attempt, is being
        suspended already, or has been preempted enough."""
        row = await self.db.one(
            """
            WITH asked AS (
                UPDATE jobs SET suspend_requested = true, suspend_reason = %(reason)s
                WHERE id = %(id)s AND attempt = %(attempt)s AND status = 'RUNNING'
                  AND NOT suspend_requested AND preemptions < %(max)s
                RETURNING worker_id
            )
            SELECT w.address FROM asked JOIN workers w ON w.id = asked.worker_id
            """,
            {"id": job_id, "attempt": attempt, "max": max_preemptions, "reason": reason},
        )
        return row["address"] if row is not None else None

    async def suspend_reasons(self, job_ids: Sequence[str]) -> dict[str, str]:
        """Why the scheduler asked these jobs to suspend, by id (those it asked)."""
        rows = await self.db.all(
            "SELECT id, suspend_reason FROM jobs WHERE id = ANY(%s) AND suspend_requested", (list(job_ids),)
        )
        return {row["id"]: row["suspend_reason"] for row in rows}

    async def prune(self) -> int:
        """Drops the checkpoints of jobs that have ended, however they ended (stored,
        failed, cancelled, expired); returns how many. One sweep for every way a job
        can end, rather than a delete in each."""
        return await self.db.run(
            "DELETE FROM job_checkpoints c USING jobs j WHERE c.job_id = j.id AND j.status = ANY(%s)",
            ([st.value for st in TERMINAL],),
        )

    async def running(self) -> list[RunningJobRecord]:
        """Every job that is sampling on a worker: what preemption chooses from."""
        return [RunningJobRecord.of(row) for row in await self.db.all(_RUNNING)]


async def _save(
    conn: AsyncConnection[DictRow],
    job_id: str,
    attempt: int,
    worker_id: str,
    *,
    step: int,
    total: int,
    data: bytes,
    now: datetime,
) -> bool:
    rows = await fetch_all(
        conn,
        _SAVE,
        {
            "id": job_id,
            "attempt": attempt,
            "worker": worker_id,
            "step": step,
            "total": total,
            "data": data,
            "now": now,
        },
    )
    return bool(rows)
