"""Writes from the worker that holds a job. Each names the attempt it belongs to and
changes nothing unless that attempt is still the job's current one on that worker:
a stale attempt (requeued, redispatched, restarted elsewhere) cannot overwrite a
newer one, and a job has at most one stored result."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import case, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from services.db.models import JobImageRow, JobRow, WorkerRow
from services.db.records import AttemptFailure, ImageRecord, JobRecord
from services.db.repository.database import Database
from services.db.repository.requeue import end_row, requeue_row
from services.db.states import HELD, STARTED, JobStatus


class Standing(enum.Enum):
    """What a running attempt learns when it reports progress."""

    CURRENT = "current"
    CANCEL_REQUESTED = "cancel requested"
    SUPERSEDED = "superseded"  # requeued or moved on: its work will not be used


class Attempts:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def _held(self, s: AsyncSession, job_id: str, attempt: int, worker_id: str, statuses) -> JobRow | None:
        return (
            await s.execute(
                select(JobRow)
                .where(
                    JobRow.id == job_id,
                    JobRow.attempt == attempt,
                    JobRow.worker_id == worker_id,
                    JobRow.status.in_([st.value for st in statuses]),
                )
                .with_for_update()
            )
        ).scalar_one_or_none()

    @staticmethod
    def _fenced(job_id: str, attempt: int, worker_id: str, statuses) -> Any:
        """An UPDATE of the job that changes nothing unless this attempt is still
        the current one on this worker, in one of ``statuses``: one round trip."""
        return update(JobRow).where(
            JobRow.id == job_id,
            JobRow.attempt == attempt,
            JobRow.worker_id == worker_id,
            JobRow.status.in_([st.value for st in statuses]),
        )

    async def start(
        self, job_id: str, attempt: int, worker_id: str, *, now: datetime, dispatched_at: datetime | None = None
    ) -> JobRecord | None:
        """Marks this attempt RUNNING on this worker; None if the job was cancelled,
        moved on or belongs to another attempt. An attempt already started here
        (its message redelivered because its outcome could not be stored) starts
        over: its result was never stored."""
        async with self.db.tx() as s:
            row = (
                await s.execute(
                    self._fenced(job_id, attempt, worker_id, HELD)
                    .values(
                        status=JobStatus.RUNNING.value,
                        started_at=case((JobRow.status == JobStatus.SCHEDULED.value, now), else_=JobRow.started_at),
                        starts=JobRow.starts + 1,
                        progress_step=0,
                        dispatched_at=dispatched_at,
                    )
                    .returning(JobRow)
                )
            ).scalar_one_or_none()
            return JobRecord.of(row) if row is not None else None

    async def progress(self, job_id: str, attempt: int, worker_id: str, step: int, total: int) -> Standing:
        async with self.db.tx() as s:
            flag = (
                await s.execute(
                    self._fenced(job_id, attempt, worker_id, STARTED)
                    .values(progress_step=step, progress_total=total)
                    .returning(JobRow.cancel_requested)
                )
            ).scalar_one_or_none()
        if flag is None:
            return Standing.SUPERSEDED
        return Standing.CANCEL_REQUESTED if flag else Standing.CURRENT

    async def decoding(self, job_id: str, attempt: int, worker_id: str, *, now: datetime) -> bool:
        async with self.db.tx() as s:
            done = await s.execute(
                self._fenced(job_id, attempt, worker_id, STARTED)
                .values(status=JobStatus.DECODING.value, decoding_at=now)
                .returning(JobRow.id)
            )
            return done.scalar_one_or_none() is not None

    async def finish(
        self,
        job_id: str,
        attempt: int,
        worker_id: str,
        images: Sequence[ImageRecord],
        *,
        now: datetime,
        busy_s: float,
        run_seconds: float | None = None,
        batch_rows: int | None = None,
        decoded_at: datetime | None = None,
    ) -> bool:
        """Stores the images and marks SUCCEEDED in one transaction, only if this
        attempt is still the job's current one: at most one visible result.
        ``run_seconds``: how long it ran, if that is worth learning from, in a
        batch of ``batch_rows`` images (its own, if None)."""
        async with self.db.tx() as s:
            done = await s.execute(
                self._fenced(job_id, attempt, worker_id, STARTED)
                .values(
                    status=JobStatus.SUCCEEDED.value,
                    error="",
                    finished_at=now,
                    run_seconds=run_seconds,
                    batch_rows=batch_rows,
                    decoded_at=decoded_at,
                )
                .returning(JobRow.id)
            )
            if done.scalar_one_or_none() is None:
                return False
            for image in images:
                s.add(JobImageRow(job_id=job_id, **image.__dict__))
            await s.execute(
                update(WorkerRow)
                .where(WorkerRow.id == worker_id)
                .values(completed=WorkerRow.completed + 1, busy_seconds=WorkerRow.busy_seconds + busy_s)
            )
            return True

    async def cancel(self, job_id: str, attempt: int, worker_id: str, *, now: datetime) -> bool:
        async with self.db.tx() as s:
            done = await s.execute(
                self._fenced(job_id, attempt, worker_id, STARTED)
                .values(status=JobStatus.CANCELLED.value, error="cancelled", finished_at=now)
                .returning(JobRow.id)
            )
            return done.scalar_one_or_none() is not None

    async def fail(
        self, job_id: str, attempt: int, worker_id: str, error: str, *, retryable: bool, now: datetime
    ) -> JobStatus | None:
        """Records this attempt's failure. A retryable one (the GPU, the decoder, a
        timeout) sends the job back to the queue with the failure counted: the
        scheduler fails it once it has used its attempts. One that is the job's own
        fault fails it now. Returns the job's new status, None if not current."""
        async with self.db.tx() as s:
            row = await self._held(s, job_id, attempt, worker_id, STARTED)
            if row is None:
                return None
            await s.execute(update(WorkerRow).where(WorkerRow.id == worker_id).values(errors=WorkerRow.errors + 1))
            if retryable:
                return requeue_row(row, AttemptFailure(attempt, worker_id, error), now=now)
            end_row(row, JobStatus.FAILED, error, now=now)
            return JobStatus.FAILED

    async def hand_back(self, job_id: str, attempt: int, worker_id: str, *, now: datetime) -> bool:
        """Returns a started job to the queue without counting an attempt: the
        worker stopped it (a drain), the job did nothing wrong."""
        async with self.db.tx() as s:
            row = await self._held(s, job_id, attempt, worker_id, HELD)
            if row is None:
                return False
            requeue_row(row, None, now=now)
            return True
