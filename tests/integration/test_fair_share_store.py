"""Fair shares in the store, on a real PostgreSQL: settlement adds what a tenant's
jobs sampled to its share, forgetting the old half per half-life; a placement
pass reads every tenant's oldest jobs, however long another tenant's backlog."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from services.db.repository import Repository
from services.db.tenant_records import DEFAULT_TENANT, TenantTerms
from tests.records import new_job

pytestmark = [pytest.mark.integration, pytest.mark.quick]

HALF_LIFE_S = 600.0


async def sampled(repo: Repository, job_id: str, tenant: str, busy_s: float, now: datetime) -> None:
    """The job submitted by ``tenant``, run on w1 for ``busy_s`` and finished."""
    await repo.jobs.create(new_job(id=job_id, tenant=tenant), now=now)
    row = await repo.db.one(
        "UPDATE jobs SET status = 'RUNNING', worker_id = 'w1', attempt = attempt + 1 WHERE id = %s RETURNING attempt",
        (job_id,),
    )
    assert row is not None
    assert await repo.attempts.finish(job_id, int(row["attempt"]), "w1", [], now=now, busy_s=busy_s)


async def test_settlement_adds_to_shares_and_forgets_by_half_life(replicas: tuple[Repository, Repository]) -> None:
    a, b = replicas
    start = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
    await a.tenants.create("cats", TenantTerms("free", weight=2.0), actor="test", now=start)
    await a.tenants.create("dogs", TenantTerms("free"), actor="test", now=start)
    await sampled(a, "c1", "cats", 4.0, start)
    await sampled(a, "c2", "cats", 2.0, start)
    await sampled(a, "d1", DEFAULT_TENANT, 3.0, start)
    # Two replicas settling at once: each job once, each share added once.
    await asyncio.gather(*(r.credits.settle(now=start, half_life_s=HALF_LIFE_S, limit=1) for r in (a, b, a)))
    shares = {s.tenant: s for s in await a.credits.shares()}
    assert set(shares) == {"cats", "dogs", DEFAULT_TENANT}
    assert (shares["cats"].weight, shares["cats"].used_s) == (2.0, pytest.approx(6.0))
    assert (shares["dogs"].used_s, shares["dogs"].used_at) == (0.0, None)  # a tenant that used nothing
    assert (shares[DEFAULT_TENANT].weight, shares[DEFAULT_TENANT].used_s) == (1.0, pytest.approx(3.0))

    later = start + timedelta(seconds=HALF_LIFE_S)
    await sampled(a, "c3", "cats", 1.0, later)
    await a.credits.settle(now=later, half_life_s=HALF_LIFE_S)
    cats = next(s for s in await b.credits.shares() if s.tenant == "cats")
    assert (cats.used_s, cats.used_at) == (pytest.approx(6.0 / 2 + 1.0), later)


async def test_a_pass_reads_each_tenants_oldest_jobs_past_a_backlog(replicas: tuple[Repository, Repository]) -> None:
    repo, _ = replicas
    start = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
    for i in range(30):
        await repo.jobs.create(new_job(id=f"heavy-{i:02d}", tenant="heavy"), now=start + timedelta(seconds=i))
    await repo.jobs.create(new_job(id="light-0", tenant="light"), now=start + timedelta(seconds=60))
    await repo.jobs.create(new_job(id="light-1", tenant="light"), now=start + timedelta(seconds=61))
    await repo.jobs.create(new_job(id="paid-0", tenant="heavy", lane="paid"), now=start + timedelta(seconds=62))
    async with repo.scheduling.placement_pass(limit=4, max_attempts=3, now=start + timedelta(seconds=70)) as read:
        assert read is not None
        queued = sorted(j.id for j in read.queued)
    # Per lane at most 4: each tenant's oldest first, then each one's next.
    assert queued == ["heavy-00", "heavy-01", "light-0", "light-1", "paid-0"]
    assert {j.tenant for j in read.queued if j.id.startswith("light")} == {"light"}


async def test_a_backlog_no_live_sampler_serves_hides_nothing_behind_it(
    replicas: tuple[Repository, Repository],
) -> None:
    repo, _ = replicas
    start = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    for i in range(10):
        await repo.jobs.create(
            new_job(id=f"held-{i:02d}", tenant="t", model="tiny-b"), now=start + timedelta(seconds=i)
        )
    await repo.jobs.create(new_job(id="runnable", tenant="t"), now=start + timedelta(seconds=20))
    now = start + timedelta(seconds=30)
    async with repo.scheduling.placement_pass(limit=4, max_attempts=3, now=now) as read:
        assert read is not None
        assert [j.id for j in read.queued] == [f"held-{i:02d}" for i in range(4)]  # all models: the backlog first
    async with repo.scheduling.placement_pass(limit=4, max_attempts=3, now=now, models=["tiny"]) as read:
        assert read is not None
        assert [j.id for j in read.queued] == ["runnable"]
