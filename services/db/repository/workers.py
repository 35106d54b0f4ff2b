"""The worker registry: each worker registers once per start (an incarnation),
heartbeats, and deregisters when it stops. Liveness is judged by the database's
clock, never a host's."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.db.models import JobRow, WorkerRow
from services.db.records import AttemptFailure, Registration, WarmPlan, WorkerHeartbeat, WorkerRecord
from services.db.repository.database import Database
from services.db.repository.requeue import requeue_row
from services.db.states import HELD, STARTED, WorkerKind, WorkerStatus
from services.errors import WorkerSuperseded


def fresh(stale_after_s: float) -> ColumnElement[bool]:
    """The worker's last heartbeat is recent, by the database's clock."""
    return WorkerRow.last_heartbeat > func.now() - func.make_interval(0, 0, 0, 0, 0, 0, stale_after_s)


class Workers:
    def __init__(self, db: Database) -> None:
        self.db = db

    @staticmethod
    def _values(hb: WorkerHeartbeat, incarnation: str) -> dict[str, Any]:
        return {
            **hb.__dict__,
            "kind": hb.kind.value,
            "status": hb.status.value,
            "models": list(hb.models),
            "warm_models": list(hb.warm_models),
            "incarnation": incarnation,
            "last_heartbeat": func.now(),
        }

    async def register(self, hb: WorkerHeartbeat, incarnation: str) -> Registration:
        """A worker process starts: records it under a new incarnation. The jobs an
        earlier incarnation of the same worker held go back to the queue at once
        (a started one with its attempt counted), rather than wait behind a
        heartbeat that looks fresh."""
        async with self.db.tx() as s:
            earlier = (
                await s.execute(select(WorkerRow.incarnation).where(WorkerRow.id == hb.id).with_for_update())
            ).scalar_one_or_none()
            requeued: list[str] = []
            if earlier is not None and earlier != incarnation:
                for job in await _held_rows(s, hb.id):
                    failure = (
                        AttemptFailure(job.attempt, hb.id, "the worker restarted") if job.status in STARTED else None
                    )
                    requeue_row(job, failure, now=func.now())
                    requeued.append(job.id)
            values = self._values(hb, incarnation)
            stmt = insert(WorkerRow).values(**values, started_at=func.now())
            stmt = stmt.on_conflict_do_update(index_elements=[WorkerRow.id], set_={**values, "started_at": func.now()})
            row = (await s.execute(stmt.returning(WorkerRow.primary_model, WorkerRow.planned_models))).one()
            return Registration(WarmPlan(row.primary_model, tuple(row.planned_models or ())), tuple(requeued))

    async def heartbeat(self, hb: WorkerHeartbeat, incarnation: str) -> WarmPlan:
        """Records the worker's state; returns the warm set the planner wants it to
        keep. Raises WorkerSuperseded if a newer process took this worker's id."""
        values = self._values(hb, incarnation)
        async with self.db.tx() as s:
            row = (
                await s.execute(
                    update(WorkerRow)
                    .where(WorkerRow.id == hb.id, WorkerRow.incarnation == incarnation)
                    .values(**values)
                    .returning(WorkerRow.primary_model, WorkerRow.planned_models)
                )
            ).one_or_none()
            if row is None:
                holder = (
                    await s.execute(select(WorkerRow.incarnation).where(WorkerRow.id == hb.id))
                ).scalar_one_or_none()
                if holder is not None:
                    raise WorkerSuperseded(f"worker {hb.id} was taken over by incarnation {holder}")
                # Forgotten while it was away (pruned): it registers again.
                stmt = insert(WorkerRow).values(**values, started_at=func.now())
                row = (await s.execute(stmt.returning(WorkerRow.primary_model, WorkerRow.planned_models))).one()
            return WarmPlan(row.primary_model, tuple(row.planned_models or ()))

    async def deregister(self, worker_id: str, incarnation: str) -> list[str]:
        """The worker stops: marked gone, and whatever it still holds goes back to
        the queue without counting an attempt (it stopped in order). Returns those jobs."""
        async with self.db.tx() as s:
            mine = (
                await s.execute(
                    update(WorkerRow)
                    .where(WorkerRow.id == worker_id, WorkerRow.incarnation == incarnation)
                    .values(status=WorkerStatus.GONE.value)
                    .returning(WorkerRow.id)
                )
            ).scalar_one_or_none()
            if mine is None:
                return []
            rows = await _held_rows(s, worker_id)
            for row in rows:
                requeue_row(row, None, now=func.now())
            return [row.id for row in rows]

    async def live(self, kind: WorkerKind, *, stale_after_s: float) -> list[WorkerRecord]:
        """Workers of this kind that take work: ready, with a recent heartbeat."""
        async with self.db.tx() as s:
            return await live_workers(s, kind, stale_after_s)

    async def all(self, kind: WorkerKind, *, stale_after_s: float) -> list[WorkerRecord]:
        async with self.db.tx() as s:
            rows = await s.execute(
                select(WorkerRow, fresh(stale_after_s)).where(WorkerRow.kind == kind.value).order_by(WorkerRow.id)
            )
            return [WorkerRecord.of(row, live=bool(is_fresh)) for row, is_fresh in rows]

    async def get(self, worker_id: str) -> WorkerRecord | None:
        async with self.db.tx() as s:
            row = await s.get(WorkerRow, worker_id)
            return WorkerRecord.of(row) if row is not None else None

    async def forgettable(self, *, gone_for_s: float) -> list[str]:
        """Workers silent this long that hold no job: gone for good."""
        async with self.db.tx() as s:
            holding = select(JobRow.worker_id).where(
                JobRow.worker_id.is_not(None), JobRow.status.in_([st.value for st in HELD])
            )
            rows = await s.execute(
                select(WorkerRow.id).where(~fresh(gone_for_s), WorkerRow.id.not_in(holding)).order_by(WorkerRow.id)
            )
            return list(rows.scalars())

    async def forget(self, worker_id: str, *, gone_for_s: float) -> bool:
        """Deletes the worker's row, unless it came back meanwhile."""
        async with self.db.tx() as s:
            result = await s.execute(
                delete(WorkerRow).where(WorkerRow.id == worker_id, ~fresh(gone_for_s)).returning(WorkerRow.id)
            )
            return result.scalar_one_or_none() is not None


async def live_workers(s: AsyncSession, kind: WorkerKind, stale_after_s: float) -> list[WorkerRecord]:
    rows = (
        await s.execute(
            select(WorkerRow)
            .where(WorkerRow.kind == kind.value, WorkerRow.status == WorkerStatus.READY.value, fresh(stale_after_s))
            .order_by(WorkerRow.id)
        )
    ).scalars()
    return [WorkerRecord.of(r) for r in rows]


async def _held_rows(s: AsyncSession, worker_id: str) -> list[JobRow]:
    rows = await s.execute(
        select(JobRow)
        .where(JobRow.worker_id == worker_id, JobRow.status.in_([st.value for st in HELD]))
        .order_by(JobRow.id)
        .with_for_update()
    )
    return list(rows.scalars())
