"""A tenant's limits hold under concurrency, on a real PostgreSQL: 50 submits at
once, through two repositories (two gateway replicas' pools), against room for 10
jobs, or credits for 10, let exactly 10 in and store nothing of the rest; a
repeated idempotency key is never refused and never counted twice; a rate is one
bucket for all replicas; an ended job is settled once, charged for what it
sampled but for attempts that failed through no fault of its own."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from services import quotas
from services.db.repository import Repository
from services.db.tenant_records import TenantTerms
from tests.records import new_job

pytestmark = [pytest.mark.integration, pytest.mark.quick]


def submit(tenant: str, key: str | None = None, *, cost: float = 0.0, price: float = 1.0):  # type: ignore[no-untyped-def]
    job = replace(new_job(), id=str(uuid.uuid4()), tenant=tenant, idempotency_key=key)
    return (replace(job, credits_reserved=cost, price=price), datetime.now(UTC))


async def refusals(replicas: tuple[Repository, Repository], n: int, **submitted: Any) -> list[quotas.Refusal]:
    """``n`` submits of one job each at once, alternately through either replica: the refused."""
    outcomes = await asyncio.gather(
        *(replicas[i % 2].admission.create_within_limits([submit("cats", **submitted)]) for i in range(n))
    )
    return [r for [r] in outcomes if isinstance(r, quotas.Refusal)]


async def stored_jobs(repo: Repository, tenant: str) -> int:
    row = await repo.db.one("SELECT count(*) AS n FROM jobs WHERE tenant = %s", (tenant,))
    assert row is not None
    return int(row["n"])


async def test_fifty_concurrent_submits_against_room_for_ten(replicas: tuple[Repository, Repository]) -> None:
    a, b = replicas
    await a.tenants.create("cats", TenantTerms("free", max_jobs=10), actor="test", now=datetime.now(UTC))
    refused = await refusals(replicas, 50)
    assert len(refused) == 40 and {r.limit for r in refused} == {quotas.MAX_JOBS}
    assert await stored_jobs(a, "cats") == 10
    # Another tenant, and one without limits, are not held back by it.
    await a.tenants.create("dogs", TenantTerms("free", max_jobs=1), actor="test", now=datetime.now(UTC))
    [dog] = await b.admission.create_within_limits([submit("dogs")])
    assert not isinstance(dog, quotas.Refusal)


async def test_a_repeated_key_is_neither_refused_nor_counted_twice(replicas: tuple[Repository, Repository]) -> None:
    a, _ = replicas
    await a.tenants.create("cats", TenantTerms("free", max_jobs=1), actor="test", now=datetime.now(UTC))
    first, again = await a.admission.create_within_limits([submit("cats", "k"), submit("cats", "k")])
    assert not isinstance(first, quotas.Refusal) and not isinstance(again, quotas.Refusal)
    assert again[0].id == first[0].id and (first[1], again[1]) == (False, True)
    [later] = await a.admission.create_within_limits([submit("cats", "k")])
    assert not isinstance(later, quotas.Refusal) and later == (first[0], True)
    [other] = await a.admission.create_within_limits([submit("cats", "other")])
    assert isinstance(other, quotas.Refusal)
    assert await stored_jobs(a, "cats") == 1


async def test_a_rate_is_one_bucket_for_every_replica(replicas: tuple[Repository, Repository]) -> None:
    a = replicas[0]
    # Slow enough that the bucket (one submit) does not refill while the test runs.
    await a.tenants.create("cats", TenantTerms("free", rate_per_s=0.25), actor="test", now=datetime.now(UTC))
    refused = await refusals(replicas, 12)
    assert len(refused) == 12 - 1 and {r.limit for r in refused} == {quotas.RATE}
    assert all(r.retry_after_s is not None and 3.0 < r.retry_after_s <= 4.0 for r in refused)
    assert await stored_jobs(a, "cats") == 1


async def test_fifty_concurrent_submits_against_credits_for_ten(replicas: tuple[Repository, Repository]) -> None:
    a = replicas[0]
    await a.tenants.create("cats", TenantTerms("free", credits=10.0), actor="test", now=datetime.now(UTC))
    refused = await refusals(replicas, 50, cost=1.0)
    assert len(refused) == 40 and {r.limit for r in refused} == {quotas.CREDITS}
    assert await stored_jobs(a, "cats") == 10
    # Held apart from the balance until the jobs are settled: nothing available.
    assert (await a.tenants.get("cats")).terms.credits == 10.0
    assert await a.credits.held(["cats"]) == {"cats": pytest.approx(10.0)}


async def running(repo: Repository, job_id: str) -> int:
    """Puts the job's next attempt RUNNING on worker w1, as a dispatch would; the attempt."""
    row = await repo.db.one(
        "UPDATE jobs SET status = 'RUNNING', worker_id = 'w1', attempt = attempt + 1 WHERE id = %s RETURNING attempt",
        (job_id,),
    )
    assert row is not None
    return int(row["attempt"])


async def test_an_ended_job_is_settled_once_for_what_it_sampled(replicas: tuple[Repository, Repository]) -> None:
    a, b = replicas
    now = datetime.now(UTC)
    await a.tenants.create("cats", TenantTerms("free", credits=10.0), actor="test", now=now)
    costly, plain, short = await a.admission.create_within_limits(
        [submit("cats", cost=4.0, price=2.0), submit("cats", cost=4.0), submit("cats", cost=4.0)]
    )
    assert isinstance(short, quotas.Refusal) and short.limit == quotas.CREDITS
    assert not isinstance(costly, quotas.Refusal) and not isinstance(plain, quotas.Refusal)
    costly_id, plain_id = costly[0].id, plain[0].id
    # The GPU died under it: requeued, and not charged for what it sampled.
    attempt = await running(a, costly_id)
    await a.attempts.fail(costly_id, attempt, "w1", "CUDA error", retryable=True, now=now, gpu_seconds=1.5)
    attempt = await running(a, costly_id)
    assert await a.attempts.finish(costly_id, attempt, "w1", [], now=now, busy_s=2.5)
    # Its own fault: charged.
    attempt = await running(a, plain_id)
    await a.attempts.fail(plain_id, attempt, "w1", "bad output", retryable=False, now=now, gpu_seconds=1.0)
    # Reserved until settled: 8 of the 10 held, 2 available.
    assert (await a.tenants.get("cats")).terms.credits == 10.0
    assert await a.credits.held(["cats"]) == {"cats": pytest.approx(8.0)}

    settled = await asyncio.gather(*(r.credits.settle(now=now, half_life_s=600.0) for r in (a, b)))
    [both] = [s for s in settled if s.jobs]  # each job by one replica
    assert both.jobs == 2 and sum(s.jobs for s in settled) == 2
    assert both.gpu_seconds == {"cats": pytest.approx(3.5)} and both.credits == {"cats": pytest.approx(6.0)}
    assert (await a.credits.settle(now=now, half_life_s=600.0)).jobs == 0
    costly_job, plain_job = await a.jobs.get(costly_id), await a.jobs.get(plain_id)
    assert (costly_job.gpu_seconds, costly_job.credits_charged) == (pytest.approx(2.5), pytest.approx(5.0))
    assert (plain_job.gpu_seconds, plain_job.credits_charged) == (pytest.approx(1.0), pytest.approx(1.0))
    # 10, less 5 for the one and 1 for the other; nothing held any more.
    assert (await a.tenants.get("cats")).terms.credits == pytest.approx(4.0)
    assert await a.credits.held(["cats"]) == {"cats": 0.0}
    usage = await a.credits.usage("cats", now.date())
    assert (usage.jobs, usage.gpu_seconds, usage.credits) == (2, pytest.approx(3.5), pytest.approx(6.0))
