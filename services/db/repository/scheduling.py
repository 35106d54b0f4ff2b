"""The scheduler's passes: placing queued jobs and planning warm sets, each under
its advisory lock so that replicas take turns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from services.db.models import JobRow, WorkerRow
from services.db.records import Decide, JobRecord, ShapeCount, WarmPlan, WorkerRecord
from services.db.repository.database import PLANNER_LOCK, SCHEDULER_LOCK, Database, try_lock
from services.db.repository.jobs import shape_counts
from services.db.repository.workers import live_workers
from services.db.states import HELD, JobStatus, WorkerKind


class Scheduling:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def schedule_pass(
        self, decide: Decide, *, limit: int, stale_after_s: float, max_attempts: int, now: datetime
    ) -> list[JobRecord] | None:
        """One scheduling pass under the scheduler lock. Returns the jobs now
        SCHEDULED (attempt raised, worker set), or None if another replica holds
        the lock. Jobs past their deadline or out of attempts are left to recovery."""
        async with self.db.tx() as s:
            if not await try_lock(s, SCHEDULER_LOCK):
                return None
            window = self._queue_window(limit, max_attempts, now)
            queued = [JobRecord.of(r) for r in (await s.execute(select(JobRow).where(JobRow.id.in_(window)))).scalars()]
            if not queued:
                return []
            workers = await live_workers(s, WorkerKind.SAMPLER, stale_after_s)
            assignments = decide(queued, workers, await held_jobs(s))
            scheduled: list[JobRecord] = []
            for a in assignments:
                row = (
                    await s.execute(
                        update(JobRow)
                        .where(JobRow.id == a.job_id, JobRow.status == JobStatus.QUEUED)
                        .values(
                            status=JobStatus.SCHEDULED.value,
                            worker_id=a.worker_id,
                            attempt=JobRow.attempt + 1,
                            scheduled_at=now,
                            routing=a.routing,
                            progress_step=0,
                        )
                        .returning(JobRow)
                    )
                ).scalar_one_or_none()
                if row is not None:
                    scheduled.append(JobRecord.of(row))
            return scheduled

    @staticmethod
    def _queue_window(limit: int, max_attempts: int, now: datetime) -> Any:
        """The oldest ``limit`` placeable jobs of every lane: the policy orders them
        (lanes and aging) and takes what it can place."""
        ranked = (
            select(
                JobRow.id,
                func.row_number().over(partition_by=JobRow.lane, order_by=JobRow.created_at).label("rank"),
            )
            .where(
                JobRow.status == JobStatus.QUEUED,
                JobRow.failures < max_attempts,
                or_(JobRow.deadline.is_(None), JobRow.deadline > now),
            )
            .subquery()
        )
        return select(ranked.c.id).where(ranked.c.rank <= limit)

    async def scheduled_not_started(self, *, older_than: datetime) -> list[JobRecord]:
        async with self.db.tx() as s:
            rows = (
                await s.execute(
                    select(JobRow).where(JobRow.status == JobStatus.SCHEDULED, JobRow.scheduled_at < older_than)
                )
            ).scalars()
            return [JobRecord.of(r) for r in rows]

    async def held_jobs(self) -> list[JobRecord]:
        """Every job a worker holds: scheduled to it, running or decoding."""
        async with self.db.tx() as s:
            return await held_jobs(s)

    async def held_per_worker(self) -> dict[str, int]:
        async with self.db.tx() as s:
            rows = await s.execute(
                select(JobRow.worker_id, func.count())
                .where(JobRow.status.in_([st.value for st in HELD]))
                .group_by(JobRow.worker_id)
            )
            return {worker_id: count for worker_id, count in rows if worker_id}

    async def plan_pass(
        self,
        plan: Callable[[Sequence[WorkerRecord], Sequence[ShapeCount]], dict[str, WarmPlan]],
        *,
        since: datetime,
        stale_after_s: float,
    ) -> dict[str, WarmPlan] | None:
        """One planning pass under the planner lock: the demand since ``since`` and
        the live workers in, each worker's warm set written. None if another
        replica is planning."""
        async with self.db.tx() as s:
            if not await try_lock(s, PLANNER_LOCK):
                return None
            workers = await live_workers(s, WorkerKind.SAMPLER, stale_after_s)
            demand = await shape_counts(s, JobRow.created_at >= since)
            plans = plan(workers, demand)
            for worker_id, warm in plans.items():
                await s.execute(
                    update(WorkerRow)
                    .where(WorkerRow.id == worker_id)
                    .values(primary_model=warm.primary, planned_models=list(warm.models))
                )
            return plans


async def held_jobs(s: AsyncSession) -> list[JobRecord]:
    rows = await s.execute(select(JobRow).where(JobRow.status.in_([st.value for st in HELD])))
    return [JobRecord.of(r) for r in rows.scalars()]
