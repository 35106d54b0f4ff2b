"""Storing submitted jobs: many in one statement, each submit answered with its
job as stored, or the job an earlier submit with its idempotency key made."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.columns import flat
from services.db.records import JOB_COLUMNS, JobRecord, NewJob
from services.db.repository.database import fetch_all
from services.errors import NotFound

# Many jobs in one statement: concurrent submits share a round trip and a commit.
_INSERT = f"""
INSERT INTO jobs (id, status, lane, priority, model, prompt, negative_prompt, width, height, steps,
                  guidance_scale, seed, num_images, output_format, idempotency_key, deadline,
                  trace_context, tenant, price, credits_reserved, created_at)
SELECT id, 'QUEUED', lane, priority, model, prompt, negative_prompt, width, height, steps,
       guidance_scale, seed, num_images, output_format, idempotency_key, deadline, trace_context, tenant,
       price, credits_reserved, created_at
FROM unnest(%(id)s::varchar[], %(lane)s::varchar[], %(priority)s::int[], %(model)s::varchar[],
            %(prompt)s::text[], %(negative_prompt)s::text[], %(width)s::int[], %(height)s::int[],
            %(steps)s::int[], %(guidance_scale)s::float8[], %(seed)s::bigint[], %(num_images)s::int[],
            %(output_format)s::varchar[], %(idempotency_key)s::varchar[], %(deadline)s::timestamptz[],
            %(trace_context)s::varchar[], %(tenant)s::varchar[], %(price)s::float8[],
            %(credits_reserved)s::float8[], %(created_at)s::timestamptz[])
     AS n(id, lane, priority, model, prompt, negative_prompt, width, height, steps, guidance_scale, seed,
          num_images, output_format, idempotency_key, deadline, trace_context, tenant, price, credits_reserved,
          created_at)
ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
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
    "tenant",
    "price",
    "credits_reserved",
)

IdempotencyKey = tuple[str, str | None]  # (tenant, key)


async def insert(conn: AsyncConnection[DictRow], submits: Sequence[tuple[NewJob, datetime]]) -> dict[str, JobRecord]:
    """Inserts the jobs QUEUED, each submitted at its time; those inserted, by id (a
    job whose idempotency key its tenant has used already is not)."""
    if not submits:
        return {}
    rows = [flat(job) for job, _ in submits]
    params: dict[str, object] = {name: [r[name] for r in rows] for name in _INSERTED_FIELDS}
    params["created_at"] = [at for _, at in submits]
    return {row["id"]: JobRecord.of(row) for row in await fetch_all(conn, _INSERT, params)}


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
