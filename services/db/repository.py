"""All of Darkroom's SQL, behind one small interface. Driver errors are translated
here, once, into ``services.errors`` exceptions."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from services.db.migrate import sync_url
from services.db.models import (
    ACTIVE_ON_WORKER,
    TERMINAL,
    JobImageRow,
    JobRow,
    JobStatus,
    LearnedEstimateRow,
    WorkerRow,
)
from services.errors import NotFound, StoreError, StoreUnavailable

# Held for the length of one scheduling pass: replicas take turns, so a job is
# placed by exactly one of them.
SCHEDULER_LOCK = 0x44524B53
# Held by the replica running a warm-set planning pass.
PLANNER_LOCK = 0x44524B50
# No Darkroom transaction waits on anything but the database; one idle this long
# belongs to a process that is frozen or gone.
IDLE_IN_TRANSACTION_MS = 3000


@dataclass(frozen=True)
class NewJob:
    id: str
    lane: str
    priority: int
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    num_images: int
    idempotency_key: str | None


@dataclass(frozen=True)
class JobRecord:
    id: str
    status: JobStatus
    lane: str
    priority: int
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    num_images: int
    idempotency_key: str | None
    attempt: int
    worker_id: str | None
    error: str
    progress_step: int
    progress_total: int
    routing: dict[str, Any] | None
    cancel_requested: bool
    created_at: datetime
    scheduled_at: datetime | None
    started_at: datetime | None
    decoding_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def of(cls, row: JobRow) -> JobRecord:
        values = {name: getattr(row, name) for name in cls.__dataclass_fields__}
        values["status"] = JobStatus(row.status)
        return cls(**values)


@dataclass(frozen=True)
class ImageRecord:
    index: int
    data: bytes
    mime_type: str
    width: int
    height: int
    seed: int


@dataclass(frozen=True)
class WorkerRecord:
    id: str
    kind: str
    address: str
    device: str
    status: str
    models: tuple[str, ...]
    warm_models: tuple[str, ...]
    vram_total_bytes: int
    vram_used_bytes: int
    temperature_c: float
    speed: float
    completed: int
    errors: int
    busy_seconds: float
    telemetry: dict[str, Any]
    started_at: datetime
    last_heartbeat: datetime
    planned_models: tuple[str, ...] = ()
    primary_model: str | None = None

    @classmethod
    def of(cls, row: WorkerRow) -> WorkerRecord:
        values = {name: getattr(row, name) for name in cls.__dataclass_fields__}
        values["models"] = tuple(row.models)
        values["warm_models"] = tuple(row.warm_models)
        values["planned_models"] = tuple(row.planned_models or ())
        return cls(**values)


@dataclass(frozen=True)
class WorkerHeartbeat:
    id: str
    kind: str
    address: str
    device: str
    models: tuple[str, ...]
    warm_models: tuple[str, ...]
    vram_total_bytes: int = 0
    vram_used_bytes: int = 0
    temperature_c: float = 0.0
    speed: float = 1.0
    status: str = "ready"
    telemetry: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Assignment:
    """The scheduler's decision for one job: where it goes and why."""

    job_id: str
    worker_id: str
    routing: dict[str, Any]


@dataclass(frozen=True)
class Totals:
    requests: int
    queued: int
    running: int
    completed: int
    failed: int
    cancelled: int


# Decides placements for one pass, given the queued jobs, the live workers and the
# jobs the workers already hold. Pure: the scheduler's policy.
Decide = Callable[[Sequence[JobRecord], Sequence[WorkerRecord], Sequence[JobRecord]], Sequence[Assignment]]


@dataclass(frozen=True)
class ShapeCount:
    """How many jobs of one shape: for demand and for the work queued ahead."""

    model: str
    width: int
    height: int
    steps: int
    num_images: int
    count: int


@dataclass(frozen=True)
class WarmPlan:
    primary: str | None
    models: tuple[str, ...]


# A learned estimate as stored: (mean, count).
Estimate = tuple[float, int]
# Given the stored entry for one shape (or None) and every worker's speed, returns
# the new shape entry and the new entry for the worker that observed it.
Learn = Callable[[Estimate | None, dict[str, Estimate]], tuple[Estimate, Estimate]]


class Repository:
    def __init__(self, database_url: str, *, pool_size: int = 10, application_name: str = "darkroom") -> None:
        self.engine = create_async_engine(
            sync_url(database_url),
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_pre_ping=True,
            connect_args={
                "application_name": application_name[:63],
                "connect_timeout": 5,
                # A peer that vanishes (host down, cable out) is noticed on both
                # ends within seconds, so a dead replica's scheduler lock, which
                # lives as long as its transaction, does not outlive it.
                "keepalives": 1,
                "keepalives_idle": 5,
                "keepalives_interval": 2,
                "keepalives_count": 3,
                "tcp_user_timeout": 10_000,
                "options": " ".join(
                    [
                        "-c tcp_keepalives_idle=5",
                        "-c tcp_keepalives_interval=2",
                        "-c tcp_keepalives_count=3",
                        # A frozen process (SIGSTOP, a stalled VM) keeps its socket
                        # open; the server ends its transaction, and lock, after this.
                        f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
                    ]
                ),
            },
        )
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    async def close(self) -> None:
        await self.engine.dispose()

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[AsyncSession]:
        try:
            async with self._sessions() as session, session.begin():
                yield session
        except (OperationalError, InterfaceError) as exc:
            raise StoreUnavailable(f"database unavailable: {exc.orig or exc}") from exc
        except (DBAPIError, SQLAlchemyError) as exc:
            raise StoreError(f"database error: {exc}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"database unavailable: {exc}") from exc

    async def ping(self) -> None:
        async with self._tx() as s:
            await s.execute(text("SELECT 1"))

    # -- jobs, from the gateway ------------------------------------------------

    async def create_job(self, job: NewJob, *, now: datetime) -> tuple[JobRecord, bool]:
        """Inserts a QUEUED job; returns it and whether an earlier submit with the
        same idempotency key already made it (then nothing new is stored)."""
        values = {**job.__dict__, "status": JobStatus.QUEUED.value, "created_at": now}
        async with self._tx() as s:
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

    async def get_job(self, job_id: str) -> JobRecord:
        async with self._tx() as s:
            row = await s.get(JobRow, job_id)
            if row is None:
                raise NotFound(f"job {job_id} not found")
            return JobRecord.of(row)

    async def find_by_idempotency_key(self, key: str) -> JobRecord | None:
        async with self._tx() as s:
            row = (await s.execute(select(JobRow).where(JobRow.idempotency_key == key))).scalar_one_or_none()
            return JobRecord.of(row) if row is not None else None

    async def get_images(self, job_id: str) -> list[ImageRecord]:
        async with self._tx() as s:
            rows = (
                await s.execute(select(JobImageRow).where(JobImageRow.job_id == job_id).order_by(JobImageRow.index))
            ).scalars()
            return [ImageRecord(r.index, r.data, r.mime_type, r.width, r.height, r.seed) for r in rows]

    async def request_cancel(self, job_id: str, *, now: datetime) -> JobRecord:
        """Cancels a job that has not started at once; flags a started one, whose
        worker then stops it at the next step and records CANCELLED."""
        async with self._tx() as s:
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

    # -- scheduling --------------------------------------------------------------

    async def schedule_pass(
        self, decide: Decide, *, limit: int, stale_after_s: float, now: datetime
    ) -> list[JobRecord] | None:
        """One scheduling pass under the scheduler lock. Returns the jobs now
        SCHEDULED (attempt raised, worker set), or None if another replica holds
        the lock."""
        async with self._tx() as s:
            got = (await s.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": SCHEDULER_LOCK})).scalar()
            if not got:
                return None
            queued = [
                JobRecord.of(r)
                for r in (await s.execute(select(JobRow).where(JobRow.id.in_(self._queue_window(limit))))).scalars()
            ]
            if not queued:
                return []
            workers = await self._live_workers(s, "sampler", stale_after_s, now)
            assignments = decide(queued, workers, await self._held(s))
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
    def _queue_window(limit: int) -> Any:
        """The oldest ``limit`` queued jobs of every lane: the policy orders them
        (lanes and aging) and takes what it can place."""
        ranked = (
            select(
                JobRow.id,
                func.row_number().over(partition_by=JobRow.lane, order_by=JobRow.created_at).label("rank"),
            )
            .where(JobRow.status == JobStatus.QUEUED)
            .subquery()
        )
        return select(ranked.c.id).where(ranked.c.rank <= limit)

    async def _held_per_worker(self, s: AsyncSession) -> dict[str, int]:
        rows = await s.execute(
            select(JobRow.worker_id, func.count())
            .where(JobRow.status.in_([st.value for st in ACTIVE_ON_WORKER]))
            .group_by(JobRow.worker_id)
        )
        return {worker_id: count for worker_id, count in rows.tuples() if worker_id}

    async def scheduled_not_started(self, *, older_than: datetime) -> list[JobRecord]:
        async with self._tx() as s:
            rows = (
                await s.execute(
                    select(JobRow).where(JobRow.status == JobStatus.SCHEDULED, JobRow.scheduled_at < older_than)
                )
            ).scalars()
            return [JobRecord.of(r) for r in rows]

    # -- jobs, from the worker that holds them -----------------------------------

    async def start_job(self, job_id: str, attempt: int, worker_id: str, *, now: datetime) -> JobRecord | None:
        """SCHEDULED -> RUNNING for this attempt on this worker; None if the job was
        cancelled, moved on or belongs to another attempt."""
        async with self._tx() as s:
            row = (
                await s.execute(
                    update(JobRow)
                    .where(
                        JobRow.id == job_id,
                        JobRow.attempt == attempt,
                        JobRow.worker_id == worker_id,
                        JobRow.status == JobStatus.SCHEDULED,
                    )
                    .values(status=JobStatus.RUNNING.value, started_at=now)
                    .returning(JobRow)
                )
            ).scalar_one_or_none()
            return JobRecord.of(row) if row is not None else None

    def _current(self, job_id: str, attempt: int) -> Any:
        return and_(
            JobRow.id == job_id,
            JobRow.attempt == attempt,
            JobRow.status.in_([JobStatus.RUNNING.value, JobStatus.DECODING.value]),
        )

    async def set_progress(self, job_id: str, attempt: int, step: int, total: int) -> bool:
        async with self._tx() as s:
            result = await s.execute(
                update(JobRow)
                .where(self._current(job_id, attempt))
                .values(progress_step=step, progress_total=total)
                .returning(JobRow.cancel_requested)
            )
            flag = result.scalar_one_or_none()
            return bool(flag)

    async def set_decoding(self, job_id: str, attempt: int, *, now: datetime) -> bool:
        async with self._tx() as s:
            result = await s.execute(
                update(JobRow)
                .where(self._current(job_id, attempt))
                .values(status=JobStatus.DECODING.value, decoding_at=now)
                .returning(JobRow.id)
            )
            return result.scalar_one_or_none() is not None

    async def finish_job(
        self, job_id: str, attempt: int, images: Sequence[ImageRecord], *, now: datetime, busy_s: float
    ) -> bool:
        """Stores the images and marks SUCCEEDED in one transaction, only if this
        attempt is still the job's current one: at most one visible result."""
        async with self._tx() as s:
            row = (
                await s.execute(
                    update(JobRow)
                    .where(self._current(job_id, attempt))
                    .values(status=JobStatus.SUCCEEDED.value, finished_at=now, error="")
                    .returning(JobRow.worker_id)
                )
            ).scalar_one_or_none()
            if row is None:
                return False
            for image in images:
                s.add(JobImageRow(job_id=job_id, **image.__dict__))
            await s.execute(
                update(WorkerRow)
                .where(WorkerRow.id == row)
                .values(completed=WorkerRow.completed + 1, busy_seconds=WorkerRow.busy_seconds + busy_s)
            )
            return True

    async def end_job(self, job_id: str, attempt: int, status: JobStatus, *, error: str, now: datetime) -> bool:
        """Ends this attempt as FAILED or CANCELLED, if it is still the current one."""
        assert status in TERMINAL and status != JobStatus.SUCCEEDED
        async with self._tx() as s:
            worker = (
                await s.execute(
                    update(JobRow)
                    .where(self._current(job_id, attempt))
                    .values(status=status.value, finished_at=now, error=error)
                    .returning(JobRow.worker_id)
                )
            ).scalar_one_or_none()
            if worker is None:
                return False
            if status == JobStatus.FAILED:
                await s.execute(update(WorkerRow).where(WorkerRow.id == worker).values(errors=WorkerRow.errors + 1))
            return True

    # -- workers -----------------------------------------------------------------

    async def heartbeat(self, hb: WorkerHeartbeat, *, now: datetime) -> WarmPlan:
        """Records the worker's state; returns the warm set the planner wants it to keep."""
        values = {**hb.__dict__, "models": list(hb.models), "warm_models": list(hb.warm_models), "last_heartbeat": now}
        async with self._tx() as s:
            stmt = insert(WorkerRow).values(**values, started_at=now)
            stmt = stmt.on_conflict_do_update(index_elements=[WorkerRow.id], set_=values)
            row = (await s.execute(stmt.returning(WorkerRow.primary_model, WorkerRow.planned_models))).one()
            return WarmPlan(row.primary_model, tuple(row.planned_models or ()))

    async def remove_worker(self, worker_id: str) -> None:
        async with self._tx() as s:
            await s.execute(update(WorkerRow).where(WorkerRow.id == worker_id).values(status="gone"))

    async def live_workers(self, kind: str, *, stale_after_s: float, now: datetime) -> list[WorkerRecord]:
        async with self._tx() as s:
            return await self._live_workers(s, kind, stale_after_s, now)

    async def _live_workers(
        self, s: AsyncSession, kind: str, stale_after_s: float, now: datetime
    ) -> list[WorkerRecord]:
        rows = (
            await s.execute(
                select(WorkerRow)
                .where(
                    WorkerRow.kind == kind,
                    WorkerRow.status == "ready",
                    WorkerRow.last_heartbeat > now - timedelta(seconds=stale_after_s),
                )
                .order_by(WorkerRow.id)
            )
        ).scalars()
        return [WorkerRecord.of(r) for r in rows]

    async def get_worker(self, worker_id: str) -> WorkerRecord | None:
        async with self._tx() as s:
            row = await s.get(WorkerRow, worker_id)
            return WorkerRecord.of(row) if row is not None else None

    async def all_workers(self, kind: str) -> list[WorkerRecord]:
        async with self._tx() as s:
            rows = (await s.execute(select(WorkerRow).where(WorkerRow.kind == kind).order_by(WorkerRow.id))).scalars()
            return [WorkerRecord.of(r) for r in rows]

    async def held_per_worker(self) -> dict[str, int]:
        async with self._tx() as s:
            return await self._held_per_worker(s)

    async def queued_ahead_shapes(self, priority: int) -> list[ShapeCount]:
        """The queued jobs that would run before a new one of this priority, by shape."""
        async with self._tx() as s:
            return await self._shape_counts(s, JobRow.status == JobStatus.QUEUED, JobRow.priority >= priority)

    async def _shape_counts(self, s: AsyncSession, *where: Any) -> list[ShapeCount]:
        cols = (JobRow.model, JobRow.width, JobRow.height, JobRow.steps, JobRow.num_images)
        rows = await s.execute(select(*cols, func.count()).where(*where).group_by(*cols))
        return [ShapeCount(*row) for row in rows.tuples()]

    async def held_jobs(self) -> list[JobRecord]:
        """Every job a worker holds: scheduled to it, running or decoding."""
        async with self._tx() as s:
            return await self._held(s)

    async def _held(self, s: AsyncSession) -> list[JobRecord]:
        rows = await s.execute(select(JobRow).where(JobRow.status.in_([st.value for st in ACTIVE_ON_WORKER])))
        return [JobRecord.of(r) for r in rows.scalars()]

    # -- learned estimates ---------------------------------------------------------

    async def learned_estimates(self) -> tuple[dict[str, Estimate], dict[str, Estimate]]:
        """Every learned (shape durations, worker speeds)."""
        async with self._tx() as s:
            rows = (await s.execute(select(LearnedEstimateRow))).scalars()
            shapes: dict[str, Estimate] = {}
            speeds: dict[str, Estimate] = {}
            for r in rows:
                (shapes if r.kind == "shape" else speeds)[r.key] = (r.mean, r.count)
            return shapes, speeds

    async def learn(self, shape_key: str, worker_id: str, learn: Learn, *, now: datetime) -> None:
        """Folds one observed duration into the stored estimates, atomically."""
        async with self._tx() as s:
            shape = (
                await s.execute(
                    select(LearnedEstimateRow)
                    .where(LearnedEstimateRow.kind == "shape", LearnedEstimateRow.key == shape_key)
                    .with_for_update()
                )
            ).scalar_one_or_none()
            speeds = {
                r.key: (r.mean, r.count)
                for r in (
                    await s.execute(select(LearnedEstimateRow).where(LearnedEstimateRow.kind == "speed"))
                ).scalars()
            }
            new_shape, new_speed = learn((shape.mean, shape.count) if shape else None, speeds)
            for kind, key, (mean, count) in (("shape", shape_key, new_shape), ("speed", worker_id, new_speed)):
                values = {"kind": kind, "key": key, "mean": mean, "count": count, "updated_at": now}
                stmt = insert(LearnedEstimateRow).values(**values)
                await s.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[LearnedEstimateRow.kind, LearnedEstimateRow.key],
                        set_={"mean": mean, "count": count, "updated_at": now},
                    )
                )

    # -- warm-set planning -----------------------------------------------------------

    async def plan_pass(
        self,
        plan: Callable[[Sequence[WorkerRecord], Sequence[ShapeCount]], dict[str, WarmPlan]],
        *,
        since: datetime,
        stale_after_s: float,
        now: datetime,
    ) -> dict[str, WarmPlan] | None:
        """One planning pass under the planner lock: the demand since ``since`` and
        the live workers in, each worker's warm set written. None if another
        replica is planning."""
        async with self._tx() as s:
            got = (await s.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": PLANNER_LOCK})).scalar()
            if not got:
                return None
            workers = await self._live_workers(s, "sampler", stale_after_s, now)
            demand = await self._shape_counts(s, JobRow.created_at >= since)
            plans = plan(workers, demand)
            for worker_id, warm in plans.items():
                await s.execute(
                    update(WorkerRow)
                    .where(WorkerRow.id == worker_id)
                    .values(primary_model=warm.primary, planned_models=list(warm.models))
                )
            return plans

    async def totals(self) -> Totals:
        async with self._tx() as s:
            counts = dict((await s.execute(select(JobRow.status, func.count()).group_by(JobRow.status))).tuples().all())
        running = sum(counts.get(st.value, 0) for st in ACTIVE_ON_WORKER)
        return Totals(
            requests=sum(counts.values()),
            queued=counts.get(JobStatus.QUEUED.value, 0),
            running=running,
            completed=counts.get(JobStatus.SUCCEEDED.value, 0),
            failed=counts.get(JobStatus.FAILED.value, 0),
            cancelled=counts.get(JobStatus.CANCELLED.value, 0),
        )
