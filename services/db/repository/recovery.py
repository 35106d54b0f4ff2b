"""Recovery, as procrastinate's stalled-jobs API does it: find the jobs that can no
longer finish where they are (their worker is dead, they ran past their timeout,
they waited past their deadline, they used their attempts), let the scheduler's
pure recovery policy decide, and apply its decisions, fenced by attempt, under
the scheduler lock so that one replica at a time does it."""

from __future__ import annotations

from dataclasses import asdict

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.db.models import JobRow, WorkerRow
from services.db.records import DeadWorker, Expire, Fail, JobRecord, Recovery, Requeue, Review
from services.db.repository.database import SCHEDULER_LOCK, Database, try_lock
from services.db.repository.requeue import end_row, requeue_row
from services.db.repository.workers import fresh
from services.db.states import HELD, STARTED, JobStatus, WorkerStatus


class Recoveries:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def recovery_pass(
        self,
        review: Review,
        *,
        stale_after_s: float,
        judge_heartbeats: bool,
        max_attempts: int,
        shortest_timeout_s: float,
    ) -> list[Recovery] | None:
        """One recovery pass; returns what it did, or None if another replica holds
        the scheduler lock. ``judge_heartbeats`` False: heartbeats may be stale
        because the database itself was away, so only workers that said they
        stopped count as dead."""
        async with self.db.tx() as s:
            if not await try_lock(s, SCHEDULER_LOCK):
                return None
            dead = await self._dead_workers(s, stale_after_s, judge_heartbeats)
            dead_ids = [d.id for d in dead]
            held = JobRow.status.in_([st.value for st in HELD])
            started = JobRow.status.in_([st.value for st in STARTED])
            unknown_worker = ~select(WorkerRow.id).where(WorkerRow.id == JobRow.worker_id).exists()
            rows = (
                (
                    await s.execute(
                        select(JobRow)
                        .where(
                            or_(
                                and_(held, or_(JobRow.worker_id.in_(dead_ids), unknown_worker)),
                                and_(
                                    JobRow.status == JobStatus.QUEUED,
                                    or_(JobRow.deadline < func.now(), JobRow.failures >= max_attempts),
                                ),
                                and_(
                                    started,
                                    JobRow.started_at
                                    < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, shortest_timeout_s),
                                ),
                            )
                        )
                        .order_by(JobRow.id)
                        .with_for_update(skip_locked=True)
                    )
                )
                .scalars()
                .all()
            )
            if not rows:
                return []
            holders = {r.worker_id for r in rows if r.worker_id is not None}
            known = set((await s.execute(select(WorkerRow.id).where(WorkerRow.id.in_(holders)))).scalars())
            dead += [DeadWorker(w, "unknown worker") for w in sorted(holders - known)]
            now = (await s.execute(select(func.now()))).scalar_one()
            actions = review([JobRecord.of(r) for r in rows], dead, now)
            by_id = {r.id: r for r in rows}
            done: list[Recovery] = []
            for action in actions:
                row = by_id.get(action.job_id)
                if row is None or row.attempt != action.attempt:
                    continue
                if isinstance(action, Requeue):
                    if row.status != action.status:
                        continue
                    requeue_row(row, action.failure, now=now)
                elif isinstance(action, Fail):
                    if row.status != action.status:
                        continue
                    if action.failure is not None:
                        row.failures += 1
                        row.attempt_log = [*row.attempt_log, asdict(action.failure)]
                    end_row(row, JobStatus.FAILED, action.reason, now=now)
                elif isinstance(action, Expire):
                    if row.status != JobStatus.QUEUED:
                        continue
                    end_row(row, JobStatus.EXPIRED, "deadline passed while queued", now=now)
                done.append(action)
            return done

    @staticmethod
    async def _dead_workers(s: AsyncSession, stale_after_s: float, judge_heartbeats: bool) -> list[DeadWorker]:
        age = func.extract("epoch", func.now() - WorkerRow.last_heartbeat)
        gone = WorkerRow.status == WorkerStatus.GONE.value
        where = or_(gone, ~fresh(stale_after_s)) if judge_heartbeats else gone
        rows = await s.execute(select(WorkerRow.id, WorkerRow.status, age).where(where).order_by(WorkerRow.id))
        return [
            DeadWorker(wid, "the worker stopped" if status == WorkerStatus.GONE else f"no heartbeat for {secs:.0f}s")
            for wid, status, secs in rows
        ]
