"""Jobs as clients see them: submit, read, cancel, count."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.db.models import JobImageRow, JobRow
from services.db.records import ImageRecord, JobRecord, LaneCount, NewJob, ShapeCount, Totals
from services.db.repository.database import Database
from services.db.states import HELD, JobStatus
from services.errors import NotFound


class Jobs:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, job: NewJob, *, now: datetime) -> tuple[JobRecord, bool]:
        """Inserts a QUEUED job; returns it and whether an earlier submit with the
        same idempotency key already made it (then nothing new is stored)."""
        values = {**job.__dict__, "status": JobStatus.QUEUED.value, "created_at": now}
        async with self.db.tx() as s:
            stmt = insert(JobRow).values(**values)
            if job.idempotency_key:
                stmt = stmt.on_conflict_do_nothing(
                    index_elements=["idempotency_key"], index_where=text("idempotency_key IS NOT NULL")
                )
            inserted = (await s.execute(stmt.returning(JobRow.id))).scalar_one_or_none()
            if inserted is None:
                same_key = select(JobRow).where(JobRow.idempotency_key == job.idempotency_key)
                row = (await s.execute(same_key)).scalar_one()
                return JobRecord.of(row), True
            row = (await s.execute(select(JobRow).where(JobRow.id == job.id))).scalar_one()
            return JobRecord.of(row), False

    async def get(self, job_id: str) -> JobRecord:
        async with self.db.tx() as s:
            row = await s.get(JobRow, job_id)
            if row is None:
                raise NotFound(f"job {job_id} not found")
            return JobRecord.of(row)

    async def get_many(self, job_ids: Sequence[str]) -> list[JobRecord]:
        """The jobs of ``job_ids`` that exist, in no particular order."""
        if not job_ids:
            return []
        async with self.db.tx() as s:
            rows = (await s.execute(select(JobRow).where(JobRow.id.in_(list(job_ids))))).scalars()
            return [JobRecord.of(r) for r in rows]

    async def find_by_idempotency_key(self, key: str) -> JobRecord | None:
        async with self.db.tx() as s:
            row = (await s.execute(select(JobRow).where(JobRow.idempotency_key == key))).scalar_one_or_none()
            return JobRecord.of(row) if row is not None else None

    async def images(self, job_id: str) -> list[ImageRecord]:
        async with self.db.tx() as s:
            rows = (
                await s.execute(select(JobImageRow).where(JobImageRow.job_id == job_id).order_by(JobImageRow.index))
            ).scalars()
            return [ImageRecord(r.index, r.data, r.mime_type, r.width, r.height, r.seed) for r in rows]

    async def request_cancel(self, job_id: str, *, now: datetime) -> JobRecord:
        """Cancels a job that has not started at once; flags a started one, whose
        worker then stops it at the next step and records CANCELLED."""
        async with self.db.tx() as s:
            row = (await s.execute(select(JobRow).where(JobRow.id == job_id).with_for_update())).scalar_one_or_none()
            if row is None:
                raise NotFound(f"job {job_id} not found")
            if row.status in (JobStatus.QUEUED, JobStatus.SCHEDULED):
                row.status = JobStatus.CANCELLED.value
                row.finished_at = now
                row.cancel_requested = True
            elif row.status in (JobStatus.RUNNING, JobStatus.DECODING):
                row.cancel_requested = True
            return JobRecord.of(row)

    async def queued_ahead_shapes(self, priority: int) -> list[ShapeCount]:
        """The queued jobs that would run before a new one of this priority, by shape."""
        async with self.db.tx() as s:
            return await shape_counts(s, JobRow.status == JobStatus.QUEUED, JobRow.priority >= priority)

    async def totals(self) -> Totals:
        async with self.db.tx() as s:
            counts = dict((await s.execute(select(JobRow.status, func.count()).group_by(JobRow.status))).all())
        return Totals(
            requests=sum(counts.values()),
            queued=counts.get(JobStatus.QUEUED.value, 0),
            running=sum(counts.get(st.value, 0) for st in HELD),
            completed=counts.get(JobStatus.SUCCEEDED.value, 0),
            failed=counts.get(JobStatus.FAILED.value, 0),
            cancelled=counts.get(JobStatus.CANCELLED.value, 0),
            expired=counts.get(JobStatus.EXPIRED.value, 0),
        )

    async def counts_by_lane(self) -> list[LaneCount]:
        """Jobs per state and lane, with the oldest of each: one GROUP BY over the
        table, for the metrics."""
        async with self.db.tx() as s:
            cols = (JobRow.status, JobRow.lane)
            rows = await s.execute(select(*cols, func.count(), func.min(JobRow.created_at)).group_by(*cols))
            return [LaneCount(JobStatus(status), lane, count, oldest) for status, lane, count, oldest in rows]


async def shape_counts(s: AsyncSession, *where: Any) -> list[ShapeCount]:
    cols = (JobRow.model, JobRow.width, JobRow.height, JobRow.steps, JobRow.num_images)
    rows = await s.execute(select(*cols, func.count()).where(*where).group_by(*cols))
    return [ShapeCount(*row) for row in rows]
