"""Writes from the worker that holds a job. Each names the attempt it belongs to and
changes nothing unless that attempt is still the job's current one on that worker:
a stale attempt (requeued, redispatched, restarted elsewhere) cannot overwrite a
newer one, and a job has at most one stored result.

The writes a worker makes for a batch of jobs (start, decoding, finish) take every
job of the batch in one statement."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from services.db.attempt_records import Result, Standing, StartRequest, StepReport
from services.db.records import JOB_FIELDS, AttemptFailure, ImageRecord, JobRecord
from services.db.repository.database import Area
from services.db.repository.requeue import charge, end, requeue
from services.db.states import HELD, STARTED, JobStatus

_HELD = [st.value for st in HELD]
# A started job as its worker reads it back: all of it but its routing (why the
# scheduler chose the worker, which the worker does not need and can be long).
_STARTED_COLUMNS = ", ".join("NULL AS routing" if name == "routing" else f"j.{name}" for name in JOB_FIELDS)
_STARTED = [st.value for st in STARTED]
# This attempt is still the job's current one on this worker, in one of %(statuses)s.
_CURRENT = "j.worker_id = %(worker)s AND j.status = ANY(%(statuses)s)"


class Attempts(Area):
    async def start(
        self, job_id: str, attempt: int, worker_id: str, *, now: datetime, dispatched_at: datetime | None = None
    ) -> JobRecord | None:
        """Marks this attempt RUNNING on this worker; None if the job was cancelled,
        moved on or belongs to another attempt."""
        started = await self.start_many([StartRequest(job_id, attempt, dispatched_at)], worker_id, now=now)
        return started.get(job_id)

    async def start_many(
        self, requests: Sequence[StartRequest], worker_id: str, *, now: datetime
    ) -> dict[str, JobRecord]:
        """Marks each attempt RUNNING on this worker; returns the jobs that are, by id
        (one cancelled, moved on or of another attempt is left out). An attempt
        already started here (its message redelivered because its outcome could not
        be stored) starts over: its result was never stored."""
        if not requests:
            return {}
        rows = await self.db.all(
            f"""
            UPDATE jobs AS j SET
                status = 'RUNNING',
                started_at = CASE WHEN j.status = 'SCHEDULED' THEN %(now)s ELSE j.started_at END,
                starts = j.starts + 1,
                progress_step = j.checkpoint_step,
                dispatched_at = r.dispatched_at,
                -- An attempt that starts from a checkpoint resumes the job (once, however
                -- often its dispatch is redelivered).
                suspend_log = CASE WHEN j.status = 'SCHEDULED' AND j.checkpoint_step > 0
                    THEN j.suspend_log || jsonb_build_array(jsonb_build_object(
                        'kind', 'resumed', 'attempt', j.attempt, 'worker_id', %(worker)s::text,
                        'step', j.checkpoint_step, 'total', j.steps, 'at', to_jsonb(%(now)s::timestamptz)))
                    ELSE j.suspend_log END
            FROM unnest(%(ids)s::varchar[], %(attempts)s::int[], %(dispatched)s::timestamptz[])
                 AS r(id, attempt, dispatched_at)
            WHERE j.id = r.id AND j.attempt = r.attempt AND {_CURRENT}
            RETURNING {_STARTED_COLUMNS}
            """,
            {
                "now": now,
                "worker": worker_id,
                "statuses": _HELD,
                "ids": [r.job_id for r in requests],
                "attempts": [r.attempt for r in requests],
                "dispatched": [r.dispatched_at for r in requests],
            },
        )
        return {row["id"]: JobRecord.of(row) for row in rows}

    async def progress_many(self, reports: Sequence[StepReport], worker_id: str) -> dict[str, Standing]:
        """Records the progress of a batch's jobs in one statement; what each attempt
        learns back, by job id (SUPERSEDED for one no longer current here)."""
        if not reports:
            return {}
        rows = await self.db.all(
            f"""
            UPDATE jobs AS j SET progress_step = r.step, progress_total = r.total
            FROM unnest(%(ids)s::varchar[], %(attempts)s::int[], %(steps)s::int[], %(totals)s::int[])
                AS r(id, attempt, step, total)
            WHERE j.id = r.id AND j.attempt = r.attempt AND {_CURRENT}
            RETURNING j.id, j.cancel_requested, j.suspend_requested
            """,
            {
                "worker": worker_id,
                "statuses": _STARTED,
                "ids": [r.job_id for r in reports],
                "attempts": [r.attempt for r in reports],
                "steps": [r.step for r in reports],
                "totals": [r.total for r in reports],
            },
        )
        standings = {r.job_id: Standing.SUPERSEDED for r in reports}
        for row in rows:
            standings[row["id"]] = (
                Standing.CANCEL_REQUESTED
                if row["cancel_requested"]
                else Standing.SUSPEND_REQUESTED
                if row["suspend_requested"]
                else Standing.CURRENT
            )
        return standings

    async def decoding(
        self, jobs: Sequence[tuple[str, int]], worker_id: str, *, now: datetime, sampling_began: datetime | None = None
    ) -> set[str]:
        """Marks (job id, attempt) of a sampled batch DECODING, every step done;
        returns the ids that are. ``sampling_began``: when the batch's denoising
        began, which is when the job started on the GPU (it was RUNNING, claimed,
        earlier: while the batch before it finished)."""
        if not jobs:
            return set()
        rows = await self.db.all(
            f"""
            UPDATE jobs AS j SET
                status = 'DECODING', decoding_at = %(now)s,
                started_at = GREATEST(j.started_at, COALESCE(%(began)s::timestamptz, j.started_at)),
                progress_step = CASE WHEN j.progress_total > 0 THEN j.progress_total ELSE j.steps END,
                progress_total = CASE WHEN j.progress_total > 0 THEN j.progress_total ELSE j.steps END
            FROM unnest(%(ids)s::varchar[], %(attempts)s::int[]) AS r(id, attempt)
            WHERE j.id = r.id AND j.attempt = r.attempt AND {_CURRENT}
            RETURNING j.id
            """,
            {
                "now": now,
                "began": sampling_began,
                "worker": worker_id,
                "statuses": _STARTED,
                "ids": [job_id for job_id, _ in jobs],
                "attempts": [attempt for _, attempt in jobs],
            },
        )
        return {row["id"] for row in rows}

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
        ``decoded_at``: when its images were decoded (``now`` if not given)."""
        result = Result(job_id, attempt, images, decoded_at or now, busy_s, run_seconds, batch_rows)
        return job_id in await self.finish_many([result], worker_id)

    async def finish_many(self, results: Sequence[Result], worker_id: str) -> set[str]:
        """Stores each result's images and marks its job SUCCEEDED, all in one
        statement (one round trip, one commit), each only if its attempt is still
        current here; returns the ids stored. ``run_seconds``: how long it ran, if that is worth learning from, in a
        batch of ``batch_rows`` images (its own, if None)."""
        if not results:
            return set()
        images = [(r.job_id, image) for r in results for image in r.images]
        rows = await self.db.all(
            f"""
            WITH stored AS (
                UPDATE jobs AS j SET
                    status = 'SUCCEEDED', error = '', finished_at = clock_timestamp(), decoded_at = r.decoded_at,
                    run_seconds = r.run_seconds, batch_rows = r.batch_rows, joined_rows = r.joined_rows,
                    cached_steps = r.cached_steps,
                    gpu_seconds = j.gpu_seconds + r.busy_s
                FROM unnest(%(ids)s::varchar[], %(attempts)s::int[], %(decoded)s::timestamptz[],
                            %(run_seconds)s::float8[], %(batch_rows)s::int[], %(joined_rows)s::int[],
                            %(cached_steps)s::int[], %(busy)s::float8[])
                     AS r(id, attempt, decoded_at, run_seconds, batch_rows, joined_rows, cached_steps, busy_s)
                WHERE j.id = r.id AND j.attempt = r.attempt AND {_CURRENT}
                RETURNING j.id, r.busy_s
            ), images AS (
                INSERT INTO job_images (job_id, "index", data, mime_type, width, height, seed, nsfw_score, verdict)
                SELECT i.* FROM unnest(%(image_jobs)s::varchar[], %(indexes)s::int[], %(datas)s::bytea[],
                                       %(mime_types)s::varchar[], %(widths)s::int[], %(heights)s::int[],
                                       %(seeds)s::bigint[], %(nsfw_scores)s::float8[], %(verdicts)s::varchar[])
                     AS i(job_id, "index", data, mime_type, width, height, seed, nsfw_score, verdict)
                WHERE i.job_id IN (SELECT id FROM stored)
            ), counted AS (
                UPDATE workers SET
                    completed = completed + (SELECT count(*) FROM stored),
                    busy_seconds = busy_seconds + (SELECT coalesce(sum(busy_s), 0) FROM stored)
                WHERE id = %(worker)s AND EXISTS (SELECT 1 FROM stored)
            )
            SELECT id FROM stored
            """,
            {
                "worker": worker_id,
                "statuses": _STARTED,
                "ids": [r.job_id for r in results],
                "attempts": [r.attempt for r in results],
                "decoded": [r.decoded_at for r in results],
                "run_seconds": [r.run_seconds for r in results],
                "batch_rows": [r.batch_rows for r in results],
                "joined_rows": [r.joined_rows for r in results],
                "cached_steps": [r.cached_steps for r in results],
                "busy": [r.busy_s for r in results],
                "image_jobs": [job_id for job_id, _ in images],
                "indexes": [i.index for _, i in images],
                "datas": [i.data for _, i in images],
                "mime_types": [i.mime_type for _, i in images],
                "widths": [i.width for _, i in images],
                "heights": [i.height for _, i in images],
                "seeds": [i.seed for _, i in images],
                "nsfw_scores": [i.nsfw_score for _, i in images],
                "verdicts": [i.verdict for _, i in images],
            },
        )
        return {row["id"] for row in rows}

    async def cancel(
        self, job_id: str, attempt: int, worker_id: str, *, now: datetime, gpu_seconds: float = 0.0
    ) -> bool:
        """Ends this attempt CANCELLED, charged the ``gpu_seconds`` it sampled."""
        async with self.db.tx() as conn:
            ended = await end(
                conn,
                job_id,
                attempt,
                JobStatus.CANCELLED,
                "cancelled",
                now=now,
                guard=_CURRENT,
                params={"worker": worker_id, "statuses": _STARTED},
            )
            if ended:
                await charge(conn, job_id, gpu_seconds)
            return ended

    async def fail(
        self,
        job_id: str,
        attempt: int,
        worker_id: str,
        error: str,
        *,
        retryable: bool,
        now: datetime,
        gpu_seconds: float = 0.0,
    ) -> JobStatus | None:
        """Records this attempt's failure. A retryable one (the GPU, the decoder, a
        timeout) sends the job back to the queue with the failure counted: the
        scheduler fails it once it has used its attempts; its tenant is not charged
        for it. One that is the job's own fault fails it now, charged the
        ``gpu_seconds`` it sampled. Returns the job's new status, None if not current."""
        fenced = {"worker": worker_id, "statuses": _STARTED}
        async with self.db.tx() as conn:
            if retryable:
                failure = AttemptFailure(attempt, worker_id, error)
                changed = await requeue(conn, [(job_id, attempt, failure)], now=now, guard=_CURRENT, params=fenced)
                status = changed.get(job_id)
            else:
                ended = await end(
                    conn, job_id, attempt, JobStatus.FAILED, error, now=now, guard=_CURRENT, params=fenced
                )
                status = JobStatus.FAILED if ended else None
                if ended:
                    await charge(conn, job_id, gpu_seconds)
            if status is not None:
                await conn.execute("UPDATE workers SET errors = errors + 1 WHERE id = %s", (worker_id,))
            return status

    async def hand_back(self, job_id: str, attempt: int, worker_id: str, *, now: datetime) -> bool:
        """Returns a started job to the queue without counting an attempt: the
        worker stopped it (a drain), the job did nothing wrong."""
        async with self.db.connection() as conn:
            changed = await requeue(
                conn,
                [(job_id, attempt, None)],
                now=now,
                guard=_CURRENT,
                params={"worker": worker_id, "statuses": _HELD},
            )
        return job_id in changed
