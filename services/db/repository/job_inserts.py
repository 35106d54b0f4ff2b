"""Storing submitted jobs: many in one statement, each submit answered with its
job as stored, or the job an earlier submit with its idempotency key made."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from services.db.columns import flat
from services.db.records import JOB_COLUMNS, JobRecord, NewJob
from services.db.repository.database import fetch_all
from services.errors import NotFound

# The columns a submit sets, with their types for unnest().
_INSERTED = (
    ("id", "varchar"),
    ("lane", "varchar"),
    ("priority", "int"),
    ("model", "varchar"),
    ("prompt", "text"),
    ("expanded_prompt", "text"),
    ("negative_prompt", "text"),
    ("width", "int"),
    ("height", "int"),
    ("steps", "int"),
    ("guidance_scale", "float8"),
    ("seed", "bigint"),
    ("num_images", "int"),
    ("frames", "int"),
    ("fps", "float8"),
    ("strength", "float8"),
    ("image_digest", "varchar"),
    ("mask_digest", "varchar"),
    ("adapters", "jsonb"),
    ("task", "varchar"),
    ("previews", "int"),
    ("output_policy", "varchar"),
    ("output_format", "varchar"),
    ("idempotency_key", "varchar"),
    ("deadline", "timestamptz"),
    ("trace_context", "varchar"),
    ("tenant", "varchar"),
    ("price", "float8"),
    ("credits_reserved", "float8"),
    ("created_at", "timestamptz"),
)
_NAMES = ", ".join(name for name, _ in _INSERTED)
# Many jobs in one statement: concurrent submits share a round trip and a commit.
_INSERT_JOBS = f"""
INSERT INTO jobs (status, {_NAMES})
SELECT 'QUEUED', {_NAMES}
FROM unnest({", ".join(f"%({name})s::{kind}[]" for name, kind in _INSERTED)}) AS n({_NAMES})
ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING {JOB_COLUMNS}
"""
# Edits' and upscales' inputs go in the same statement as their jobs: no job is
# ever seen without them, and none are kept for a job that was not inserted.
_INSERT_WITH_INPUTS = f"""
WITH inserted AS ({_INSERT_JOBS}),
inputs AS (
    INSERT INTO job_inputs (job_id, image, mask)
    SELECT i.job_id, i.image, i.mask
    FROM unnest(%(input_job)s::varchar[], %(input_image)s::bytea[], %(input_mask)s::bytea[]) AS i(job_id, image, mask)
    WHERE i.job_id IN (SELECT id FROM inserted)
)
SELECT * FROM inserted
"""

IdempotencyKey = tuple[str, str | None]  # (tenant, key)


async def insert(conn: AsyncConnection[DictRow], submits: Sequence[tuple[NewJob, datetime]]) -> dict[str, JobRecord]:
    """Inserts the jobs QUEUED, each submitted at its time; those inserted, by id (a
    job whose idempotency key its tenant has used already is not)."""
    if not submits:
        return {}
    rows = [{**flat(job), "created_at": at} for job, at in submits]
    params: dict[str, object] = {name: [r[name] for r in rows] for name, _ in _INSERTED}
    params["task"] = [str(r["task"]) for r in rows]  # its value, not an Enum's name
    params["adapters"] = [Jsonb(r["adapters"]) for r in rows]
    inputs = [(job.id, job.inputs) for job, _ in submits if job.inputs is not None]
    sql = _INSERT_JOBS
    if inputs:
        sql = _INSERT_WITH_INPUTS
        params["input_job"] = [job_id for job_id, _ in inputs]
        params["input_image"] = [i.image for _, i in inputs]
        params["input_mask"] = [i.mask for _, i in inputs]
    return {row["id"]: JobRecord.of(row) for row in await fetch_all(conn, sql, params)}


async def find_earlier(conn: AsyncConnection[DictRow], jobs: Sequence[NewJob]) -> dict[IdempotencyKey, JobRecord]:
    """The stored jobs made by earlier submits with these jobs' idempotency keys."""
    keys = {(j.tenant, j.idempotency_key) for j in jobs if j.idempotency_key}
    if not keys:
        return {}
    tenants, idempotency_keys = zip(*keys, strict=True)
    rows = await fetch_all(
        conn,
        f"""
        SELECT {JOB_COLUMNS} FROM jobs
        WHERE (tenant, idempotency_key) IN (SELECT * FROM unnest(%s::varchar[], %s::varchar[]))
        """,
        (list(tenants), list(idempotency_keys)),
    )
    return {(row["tenant"], row["idempotency_key"]): JobRecord.of(row) for row in rows}


def stored(
    job: NewJob, inserted: dict[str, JobRecord], earlier: dict[IdempotencyKey, JobRecord]
) -> tuple[JobRecord, bool]:
    """The job as stored for ``job``'s submit, and whether an earlier submit made it."""
    if job.id in inserted:
        return inserted[job.id], False
    if (job.tenant, job.idempotency_key) in earlier:
        return earlier[(job.tenant, job.idempotency_key)], True
    raise NotFound(f"job {job.id} was not stored")  # pragma: no cover - a conflict is only ever on the key
