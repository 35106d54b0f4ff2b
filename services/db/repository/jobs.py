"""Jobs as clients see them: submit, read, cancel, count."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.records import JOB_COLUMNS, ImageRecord, JobRecord, LaneCount, NewJob, ShapeCount, Totals
from services.db.repository.database import Database, fetch_all
from services.db.states import HELD, JobStatus
from services.errors import NotFound

# Many jobs in one statement: concurrent submits share a round trip and a commit.
_INSERT = f"""
INSERT INTO jobs (id, status, lane, priority, model, prompt, negative_prompt, width, height, steps,
                  guidance_scale, seed, num_images, output_format, idempotency_key, deadline,
                  trace_context, created_at)
SELECT id, 'QUEUED', lane, priority, model, prompt, negative_prompt, width, height, steps,
       guidance_scale, seed, num_images, output_format, idempotency_key, deadline, trace_context, %(now)s
FROM unnest(%(id)s::varchar[], %(lane)s::varchar[], %(priority)s::int[], %(model)s::varchar[],
            %(prompt)s::text[], %(negative_prompt)s::text[], %(width)s::int[], %(height)s::int[],
            %(steps)s::int[], %(guidance_scale)s::float8[], %(seed)s::bigint[], %(num_images)s::int[],
            %(output_format)s::varchar[], %(idempotency_key)s::varchar[], %(deadline)s::timestamptz[],
            %(trace_context)s::varchar[])
     AS n(id, lane, priority, model, prompt, negative_prompt, width, height, steps, guidance_scale, seed,
          num_images, output_format, idempotency_key, deadline, trace_context)
ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING {JOB_COLUMNS}
"""
_INSERTED_FIELDS = (
    "id",
    "lane",
    "priority",
    "model",
    "prompt",
    "negative_prompt",
    "width",
    "height",
    "steps",
    "guidance_scale",
    "seed",
    "num_images",
    "output_format",
    "idempotency_key",
    "deadline",
    "trace_context",
)
_CANCELLABLE_AT_ONCE = (JobStatus.QUEUED.value, JobStatus.SCHEDULED.value)
_HELD = [st.value for st in HELD]


class Jobs:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, job: NewJob, *, now: datetime) -> tuple[JobRecord, bool]:
        """Inserts a QUEUED job; returns it and whether an earlier submit with the
        same idempotency key already made it (then nothing new is stored)."""
        [created] = await self.create_many([job], now=now)
        return created

    async def create_many(self, jobs: Sequence[NewJob], *, now: datetime) -> list[tuple[JobRecord, bool]]:
        """Inserts QUEUED jobs in one statement; per job, in order, the stored job and
        whether an earlier submit with its idempotency key had made it."""
        params: dict[str, object] = {name: [getattr(j, name) for j in jobs] for name in _INSERTED_FIELDS}
        params["now"] = now
        async with self.db.tx() as conn:
            inserted = {row["id"]: JobRecord.of(row) for row in await fetch_all(conn, _INSERT, params)}
            keys = [j.idempotency_key for j in jobs if j.id not in inserted and j.idempotency_key]
            earlier: dict[str, JobRecord] = {}
            if keys:
                rows = await fetch_all(
                    conn, f"SELECT {JOB_COLUMNS} FROM jobs WHERE idempotency_key = ANY(%s)", (list(set(keys)),)
                )
                earlier = {row["idempotency_key"]: JobRecord.of(row) for row in rows}
        results = []
        for j in jobs:
            if j.id in inserted:
                results.append((inserted[j.id], False))
            elif j.idempotency_key in earlier:
                results.append((earlier[j.idempotency_key], True))
            else:  # pragma: no cover - a conflict is only ever on the idempotency key
                raise NotFound(f"job {j.id} was not stored")
        return results

    async def get(self, job_id: str) -> JobRecord:
        row = await self.db.one(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = %s", (job_id,))
        if row is None:
            raise NotFound(f"job {job_id} not found")
        return JobRecord.of(row)

    async def get_with_images(self, job_id: str) -> tuple[JobRecord, list[ImageRecord]]:
        """The job, and its images if it has succeeded, in one transaction."""
        async with self.db.connection() as conn:
            row = await (await conn.execute(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = %s", (job_id,))).fetchone()
            if row is None:
                raise NotFound(f"job {job_id} not found")
            job = JobRecord.of(row)
            images = await _images(conn, job_id) if job.status == JobStatus.SUCCEEDED else []
        return job, images

    async def get_many(self, job_ids: Sequence[str]) -> list[JobRecord]:
        """The jobs of ``job_ids`` that exist, in no particular order."""
        if not job_ids:
            return []
        rows = await self.db.all(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ANY(%s)", (list(job_ids),))
        return [JobRecord.of(r) for r in rows]

    async def find_by_idempotency_key(self, key: str) -> JobRecord | None:
        row = await self.db.one(f"SELECT {JOB_COLUMNS} FROM jobs WHERE idempotency_key = %s", (key,))
        return JobRecord.of(row) if row is not None else None

    async def images(self, job_id: str) -> list[ImageRecord]:
        async with self.db.connection() as conn:
            return await _images(conn, job_id)

    async def request_cancel(self, job_id: str, *, now: datetime) -> tuple[JobRecord, bool]:
        """Cancels a job that has not started at once; flags a started one, whose
        worker then stops it at the next step and records CANCELLED. Returns the
        job, and whether this call ended it."""
        row = await self.db.one(
            f"""
            WITH before AS (SELECT status FROM jobs WHERE id = %(id)s FOR UPDATE)
            UPDATE jobs SET
                status = CASE WHEN status = ANY(%(at_once)s) THEN 'CANCELLED' ELSE status END,
                finished_at = CASE WHEN status = ANY(%(at_once)s) THEN %(now)s ELSE finished_at END,
                cancel_requested = cancel_requested OR status = ANY(%(held)s) OR status = 'QUEUED'
            WHERE id = %(id)s
            RETURNING {JOB_COLUMNS}, (SELECT status FROM before) = ANY(%(at_once)s) AS ended_now
            """,
            {"id": job_id, "now": now, "at_once": list(_CANCELLABLE_AT_ONCE), "held": _HELD},
        )
        if row is None:
            raise NotFound(f"job {job_id} not found")
        return JobRecord.of(row), bool(row["ended_now"])

    async def queued_ahead_shapes(self, priority: int) -> list[ShapeCount]:
        """The queued jobs that would run before a new one of this priority, by shape."""
        async with self.db.connection() as conn:
            return await shape_counts(conn, "status = 'QUEUED' AND priority >= %(priority)s", {"priority": priority})

    async def totals(self) -> Totals:
        rows = await self.db.all("SELECT status, count(*) AS n FROM jobs GROUP BY status")
        counts = {row["status"]: row["n"] for row in rows}
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
        """The jobs not yet ended, per state and lane, with the oldest of each, for
        the metrics: read from the partial indexes of queued and held jobs, never
        the whole table (ended jobs are counted as they end, by the services)."""
        rows = await self.db.all(
            """
            SELECT status, lane, count(*) AS n, min(created_at) AS oldest FROM jobs
            WHERE status = 'QUEUED' GROUP BY status, lane
            UNION ALL
            SELECT status, lane, count(*), min(created_at) FROM jobs
            WHERE status IN ('SCHEDULED', 'RUNNING', 'DECODING') GROUP BY status, lane
            """
        )
        return [LaneCount(JobStatus(r["status"]), r["lane"], r["n"], r["oldest"]) for r in rows]


async def _images(conn: AsyncConnection[DictRow], job_id: str) -> list[ImageRecord]:
    rows = await fetch_all(
        conn,
        'SELECT "index", data, mime_type, width, height, seed FROM job_images WHERE job_id = %s ORDER BY "index"',
        (job_id,),
    )
    return [ImageRecord(r["index"], r["data"], r["mime_type"], r["width"], r["height"], r["seed"]) for r in rows]


async def shape_counts(conn: AsyncConnection[DictRow], where: str, params: dict[str, object]) -> list[ShapeCount]:
    rows = await fetch_all(
        conn,
        f"""
        SELECT model, width, height, steps, num_images, count(*) AS n FROM jobs
        WHERE {where} GROUP BY model, width, height, steps, num_images
        """,
        params,
    )
    return [ShapeCount(r["model"], r["width"], r["height"], r["steps"], r["num_images"], r["n"]) for r in rows]
