"""Writes that arrive together are committed together, against a real PostgreSQL:
concurrent submits (the gateway's Coalescer over ``jobs.create_many``) and
concurrent results (a sampler's over ``attempts.finish_many``) share transactions,
each caller still gets its own answer, and a superseded attempt's write in the
same group changes nothing.

Transactions are counted by the transaction ids PostgreSQL assigned meanwhile:
every writing transaction takes one, and nothing else writes to the test's server
while a test runs (pg_stat_database's counters are flushed lazily, up to a second
late)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest

from services.coalesce import Coalescer
from services.db.records import MAX_IDEMPOTENCY_KEY, ImageRecord, JobRecord, NewJob
from services.db.repository import Repository, Result
from services.errors import StoreError
from tests.records import new_job

pytestmark = [pytest.mark.integration, pytest.mark.quick]

WORKER = "host-gpu0"
CALLERS = 40
IMAGE = ImageRecord(0, b"png", "image/png", 64, 64, 1)


async def next_xid(repo: Repository) -> int:
    row = await repo.db.one("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xid")
    assert row is not None
    return int(row["xid"])


def submit(key: str | None = None) -> NewJob:
    return new_job(id=str(uuid.uuid4()), prompt="p", seed=1, idempotency_key=key)


async def test_concurrent_submits_share_transactions_and_each_gets_its_own_answer(repo: Repository) -> None:
    create = Coalescer(repo.jobs.create_many)
    now = datetime.now(UTC)
    fresh = [submit(f"key-{i}") for i in range(CALLERS)]
    # The same key twice in one group: one job, the second told it was made before.
    twin_a, twin_b = submit("twin"), submit("twin")
    before = await next_xid(repo)
    answers = await asyncio.gather(*(create((job, now)) for job in [*fresh, twin_a, twin_b]))
    used = await next_xid(repo) - before
    assert used <= 3, f"{CALLERS + 2} submits took {used} transactions"
    assert [(job.id, earlier) for job, earlier in answers[:CALLERS]] == [(j.id, False) for j in fresh]
    (first, first_earlier), (second, second_earlier) = answers[CALLERS:]
    assert first.id == second.id == twin_a.id
    assert (first_earlier, second_earlier) == (False, True)
    assert await repo.jobs.find_by_idempotency_key(twin_a.tenant, "twin") is not None


async def test_a_bad_row_fails_its_own_caller_only(repo: Repository) -> None:
    create = Coalescer(repo.jobs.create_many)
    now = datetime.now(UTC)
    good = [submit(f"ok-{i}") for i in range(5)]
    bad = submit("k" * (MAX_IDEMPOTENCY_KEY + 1))  # longer than its column: the INSERT fails
    outcomes = await asyncio.gather(*(create((job, now)) for job in [*good, bad]), return_exceptions=True)
    assert isinstance(outcomes[-1], StoreError)
    stored = [o for o in outcomes[:-1] if not isinstance(o, BaseException)]
    assert [job.id for job, _ in stored] == [j.id for j in good]


async def running_here(repo: Repository, count: int) -> list[JobRecord]:
    """``count`` jobs RUNNING on WORKER as their first attempt."""
    now = datetime.now(UTC)
    made = await repo.jobs.create_many([(submit(), now) for _ in range(count)])
    ids = [job.id for job, _ in made]
    await repo.db.run(
        "UPDATE jobs SET status = 'RUNNING', worker_id = %s, attempt = 1, started_at = now() WHERE id = ANY(%s)",
        (WORKER, ids),
    )
    return [await repo.jobs.get(job_id) for job_id in ids]


async def test_concurrent_results_share_transactions_and_a_stale_attempt_changes_nothing(repo: Repository) -> None:
    finish: Coalescer[Result, bool] = Coalescer(lambda results: _stored_flags(repo, results))
    jobs = await running_here(repo, CALLERS)
    now = datetime.now(UTC)
    current = [Result(job.id, job.attempt, [IMAGE], now, 0.5) for job in jobs[1:]]
    # The first job's attempt 1 was superseded (requeued, redispatched as attempt 2
    # elsewhere); its old worker's result arrives with the others.
    await repo.db.run(
        "UPDATE jobs SET status = 'RUNNING', worker_id = 'other-gpu', attempt = 2 WHERE id = %s", (jobs[0].id,)
    )
    stale = Result(jobs[0].id, 1, [IMAGE], now, 0.5)
    before = await next_xid(repo)
    stored = await asyncio.gather(*(finish(r) for r in [stale, *current]))
    used = await next_xid(repo) - before
    assert used <= 3, f"{CALLERS} results took {used} transactions"
    assert stored == [False] + [True] * len(current)
    superseded, images = await repo.jobs.get_with_images(jobs[0].id)
    assert (superseded.status.value, superseded.attempt, superseded.worker_id, images) == (
        "RUNNING",
        2,
        "other-gpu",
        [],
    )
    for result in current:
        job, images = await repo.jobs.get_with_images(result.job_id)
        assert (job.status.value, [i.data for i in images]) == ("SUCCEEDED", [b"png"])


async def _stored_flags(repo: Repository, results: list[Result]) -> list[bool]:
    stored = await repo.attempts.finish_many(results, WORKER)
    return [r.job_id in stored for r in results]
