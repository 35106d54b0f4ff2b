"""Jobs as clients see them: submit, read, cancel, count."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.counts import ActiveCount, LaneCount, ShapeCount, Totals
from services.db.records import (
    JOB_COLUMNS,
    JOB_FIELDS,
    ImageRecord,
    JobCursor,
    JobRecord,
    JobState,
    NewJob,
    SuspendEvent,
)
from services.db.repository.database import Area, fetch_all
from services.db.repository.job_inserts import find_earlier, insert, stored
from services.db.repository.requeue import qualified
from services.db.states import HELD, JobStatus
from services.errors import NotFound
from services.generation import JobInputs

_WITH_IMAGES = f"""
SELECT {qualified(JOB_FIELDS, "j")}, i."index" AS image_index, i.data, i.mime_type, i.width AS image_width,
       i.height AS image_height, i.seed AS image_seed, i.nsfw_score, i.verdict
FROM jobs j LEFT JOIN job_images i ON i.job_id = j.id {{owner}}
WHERE j.id = ANY(%(ids)s) ORDER BY j.id, i."index"
"""
_ANY_WITH_IMAGES = _WITH_IMAGES.format(owner="")
# Another tenant's job found without its images: they are never read.
_OWN_WITH_IMAGES = _WITH_IMAGES.format(owner="AND j.tenant = %(tenant)s")
_CANCELLABLE_AT_ONCE = (JobStatus.QUEUED.value, JobStatus.SCHEDULED.value)
_HELD = [st.value for st in HELD]


class Jobs(Area):
    async def create(self, job: NewJob, *, now: datetime) -> tuple[JobRecord, bool]:
        """Inserts a QUEUED job; returns it and whether an earlier submit with the
        same idempotency key already made it (then nothing new is stored)."""
        [created] = await self.create_many([(job, now)])
        return created

    async def create_many(self, submits: Sequence[tuple[NewJob, datetime]]) -> list[tuple[JobRecord, bool]]:
        """Inserts QUEUED jobs, each submitted at its time, in one statement; per job,
        in order, the stored job and whether an earlier submit with its idempotency
        key had made it."""
        async with self.db.connection() as conn:
            # One statement, committed on its own. A submit whose key another has
            # inserted meanwhile waits for that one's commit, then finds its job.
            inserted = await insert(conn, submits)
            earlier = await find_earlier(conn, [job for job, _ in submits if job.id not in inserted])
        return [stored(job, inserted, earlier) for job, _ in submits]

    async def inputs(self, job_ids: Sequence[str]) -> dict[str, JobInputs]:
        """The input images (and masks) of those of these jobs that have them, by id."""
        rows = await self.db.all("SELECT job_id, image, mask FROM job_inputs WHERE job_id = ANY(%s)", (list(job_ids),))
        return {row["job_id"]: JobInputs(bytes(row["image"]), _bytes(row["mask"])) for row in rows}

    async def get(self, job_id: str) -> JobRecord:
        row = await self.db.one(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = %s", (job_id,))
        if row is None:
            raise NotFound(f"job {job_id} not found")
        return JobRecord.of(row)

    async def get_with_images(self, job_id: str) -> tuple[JobRecord, list[ImageRecord]]:
        """The job, and its images if it has succeeded, in one statement (a job has
        images only once it has succeeded: they are stored with its SUCCEEDED)."""
        [found] = await self.many_with_images([job_id])
        if found is None:
            raise NotFound(f"job {job_id} not found")
        return found

    async def many_with_images(
        self, job_ids: Sequence[str], *, tenant: str | None = None
    ) -> list[tuple[JobRecord, list[ImageRecord]] | None]:
        """``get_with_images`` of each job, in order, in one statement; None for a
        job that does not exist. With ``tenant``, the images of that tenant's jobs
        only: another's is found (to be refused) without them."""
        found: dict[str, tuple[JobRecord, list[ImageRecord]]] = {}
        query, params = (_ANY_WITH_IMAGES, {}) if tenant is None else (_OWN_WITH_IMAGES, {"tenant": tenant})
        for r in await self.db.all(query, {"ids": list(job_ids), **params}):
            if r["id"] not in found:
                found[r["id"]] = (JobRecord.of(r), [])
            images = found[r["id"]][1]
            if r["image_index"] is not None:
                images.append(
                    ImageRecord(
                        r["image_index"],
                        r["data"],
                        r["mime_type"],
                        r["image_width"],
                        r["image_height"],
                        r["image_seed"],
                        r["nsfw_score"],
                        r["verdict"],
                    )
                )
        return [found.get(job_id) for job_id in job_ids]

    async def state(self, job_id: str) -> JobState:
        """The job's status, attempt and suspensions: all a stream needs to begin."""
        [state] = await self.states([job_id])
        if state is None:
            raise NotFound(f"job {job_id} not found")
        return state

    async def states(self, job_ids: Sequence[str]) -> list[JobState | None]:
        """``state`` of each job, in order, in one statement; None for a job that
        does not exist."""
        rows = await self.db.all(
            "SELECT id, status, attempt, suspend_log, tenant, worker_id FROM jobs WHERE id = ANY(%s)",
            (list(job_ids),),
        )
        by_id = {
            r["id"]: JobState(
                JobStatus(r["status"]),
                r["attempt"],
                tuple(SuspendEvent.of(e) for e in r["suspend_log"] or ()),
                r["tenant"],
                r["worker_id"],
            )
            for r in rows
        }
        return [by_id.get(job_id) for job_id in job_ids]

    async def find_by_idempotency_key(self, tenant: str, key: str) -> JobRecord | None:
        row = await self.db.one(
            f"SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = %s AND idempotency_key = %s", (tenant, key)
        )
        return JobRecord.of(row) if row is not None else None

    async def request_cancel(self, job_id: str, *, tenant: str, now: datetime) -> tuple[JobRecord, bool]:
        """Cancels a job that has not started at once; flags a started one, whose
        worker then stops it at the next step and records CANCELLED. Returns the
        job, and whether this call ended it. Another tenant's job is not found."""
        row = await self.db.one(
            f"""
            WITH before AS (SELECT status FROM jobs WHERE id = %(id)s AND tenant = %(tenant)s FOR UPDATE)
            UPDATE jobs SET
                status = CASE WHEN status = ANY(%(at_once)s) THEN 'CANCELLED' ELSE status END,
                finished_at = CASE WHEN status = ANY(%(at_once)s) THEN %(now)s ELSE finished_at END,
                cancel_requested = cancel_requested OR status = ANY(%(held)s) OR status = 'QUEUED'
            WHERE id = %(id)s AND tenant = %(tenant)s
            RETURNING {JOB_COLUMNS}, (SELECT status FROM before) = ANY(%(at_once)s) AS ended_now
            """,
            {"id": job_id, "tenant": tenant, "now": now, "at_once": list(_CANCELLABLE_AT_ONCE), "held": _HELD},
        )
        if row is None:
            raise NotFound(f"job {job_id} not found")
        return JobRecord.of(row), bool(row["ended_now"])

    async def queued_ahead_shapes(self, priority: int) -> list[ShapeCount]:
        """The queued jobs that would run before a new one of this priority, by shape."""
        async with self.db.connection() as conn:
            return await shape_counts(conn, "status = 'QUEUED' AND priority >= %(priority)s", {"priority": priority})

    async def page(
        self, tenant: str, *, statuses: Sequence[JobStatus], after: JobCursor | None, limit: int
    ) -> list[JobRecord]:
        """A tenant's jobs, newest first, in any of ``statuses`` (any status if
        empty), from just past ``after``: the last job of the page before."""
        where = ["tenant = %(tenant)s"]
        if statuses:
            where.append("status = ANY(%(statuses)s)")
        if after is not None:
            where.append("(created_at, id) < (%(created_at)s, %(id)s)")
        rows = await self.db.all(
            f"""
            SELECT {JOB_COLUMNS} FROM jobs WHERE {" AND ".join(where)}
            ORDER BY created_at DESC, id DESC LIMIT %(limit)s
            """,
            {
                "tenant": tenant,
                "statuses": [s.value for s in statuses],
                "created_at": after.created_at if after else None,
                "id": after.id if after else None,
                "limit": limit,
            },
        )
        return [JobRecord.of(r) for r in rows]

    async def active(self, tenant: str) -> ActiveCount:
        """A tenant's jobs queued, and held by workers, now."""
        rows = await self.db.all(
            """
            SELECT status = 'QUEUED' AS queued, count(*) AS n FROM jobs
            WHERE tenant = %s AND status IN ('QUEUED', 'SCHEDULED', 'RUNNING', 'DECODING')
            GROUP BY 1
            """,
            (tenant,),
        )
        counts = {r["queued"]: r["n"] for r in rows}
        return ActiveCount(queued=counts.get(True, 0), running=counts.get(False, 0))

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


async def shape_counts(conn: AsyncConnection[DictRow], where: str, params: dict[str, object]) -> list[ShapeCount]:
    rows = await fetch_all(
        conn,
        f"""
        SELECT model, width, height, steps, num_images, frames, count(*) AS n FROM jobs
        WHERE {where} GROUP BY model, width, height, steps, num_images, frames
        """,
        params,
    )
    return [
        ShapeCount(r["model"], r["width"], r["height"], r["steps"], r["num_images"], r["n"], r["frames"]) for r in rows
    ]


def _bytes(value: bytes | memoryview | None) -> bytes | None:
    return None if value is None else bytes(value)
