"""Credits as an exact ledger, on a real PostgreSQL: a tenant's balance moves only
by entries (what it was made with, an operator's adjustments, daily top-ups,
settled jobs' charges); what its open jobs reserved is held apart from it and
released, exactly, when each is settled; a tenant without a credit limit holds
nothing. The cases of issue 31 (an operator's change while a job holds credits, an
unlimited tenant given credits mid-job, a debt over midnight, a job spanning
midnight), the same under concurrency through two replicas, the `darkroom tenants`
command, and a property over random interleavings of all of it."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services import quotas
from services.db.records import JobRecord
from services.db.repository import Repository
from services.db.states import JobStatus
from services.db.tenant_records import ADJUST, CHARGE, INITIAL, TOP_UP, TenantTerms
from services.errors import InvalidArgument
from services.ops.embedded import EmbeddedPostgres
from tests.conftest import fresh_database
from tests.records import new_job

pytestmark = [pytest.mark.integration, pytest.mark.quick]

DAY1 = datetime(2030, 3, 1, 9, 0, tzinfo=UTC)
DAY2 = DAY1 + timedelta(days=1)


async def submit(repo: Repository, tenant: str, cost: float, at: datetime) -> JobRecord | quotas.Refusal:
    """A submit of one job estimated at ``cost``, as the gateway makes it: the job, or why not."""
    job = replace(new_job(), id=str(uuid.uuid4()), tenant=tenant, credits_reserved=cost)
    [outcome] = await repo.admission.create_within_limits([(job, at)])
    return outcome if isinstance(outcome, quotas.Refusal) else outcome[0]


async def admitted(repo: Repository, tenant: str, cost: float, at: datetime) -> JobRecord:
    job = await submit(repo, tenant, cost, at)
    assert not isinstance(job, quotas.Refusal), job
    return job


async def running(repo: Repository, job_id: str) -> int:
    """Puts the job's next attempt RUNNING on worker w1, as a dispatch would; the attempt."""
    row = await repo.db.one(
        "UPDATE jobs SET status = 'RUNNING', worker_id = 'w1', attempt = attempt + 1 WHERE id = %s RETURNING attempt",
        (job_id,),
    )
    assert row is not None
    return int(row["attempt"])


async def uses(repo: Repository, job_id: str, gpu_seconds: float, at: datetime) -> None:
    """The job runs and succeeds, its batches having sampled ``gpu_seconds`` of it."""
    assert await repo.attempts.finish(job_id, await running(repo, job_id), "w1", [], now=at, busy_s=gpu_seconds)


async def balance(repo: Repository, tenant: str) -> float | None:
    return (await repo.tenants.get(tenant)).terms.credits


async def available(repo: Repository, tenant: str) -> float | None:
    return quotas.available(await balance(repo, tenant), (await repo.credits.held([tenant]))[tenant])


async def ledger(repo: Repository, tenant: str) -> dict[str, float]:
    """The sum of the tenant's entries, by kind."""
    rows = await repo.db.all(
        "SELECT kind, sum(amount) AS amount FROM credit_entries WHERE tenant = %s GROUP BY kind", (tenant,)
    )
    return {row["kind"]: row["amount"] for row in rows}


async def test_setting_credits_while_a_job_holds_some_sets_the_balance(replicas: tuple[Repository, Repository]) -> None:
    """A balance of 100, a job holding 90, the operator setting 100 again, the job
    using 10: 90 left (it was 180: the reservation given back on top of the 100)."""
    repo = replicas[0]
    await repo.tenants.create("cats", TenantTerms("free", credits=100.0), actor="test", now=DAY1)
    job = await admitted(repo, "cats", 90.0, DAY1)
    assert job.credits_reserved == 90.0
    await repo.tenants.update("cats", {"credits": 100.0}, actor="test", now=DAY1)
    # The 90 stay held against the 100 set: 10 available until the job settles.
    assert await available(repo, "cats") == 10.0
    await uses(repo, job.id, 10.0, DAY1)
    await repo.credits.settle(now=DAY1, half_life_s=600.0)
    assert await balance(repo, "cats") == 90.0
    assert await available(repo, "cats") == 90.0
    assert await ledger(repo, "cats") == {INITIAL: 100.0, CHARGE: -10.0}  # setting 100 on 100 moved nothing


async def test_an_unlimited_tenant_holds_nothing_and_is_charged_once_it_has_credits(
    replicas: tuple[Repository, Repository],
) -> None:
    """An unlimited tenant's job reserves nothing; given 0 credits mid-job, it owes
    what the job used (it was 499: the 500 it never reserved given back)."""
    repo = replicas[0]
    await repo.tenants.create("dogs", TenantTerms("free", max_jobs=5), actor="test", now=DAY1)
    job = await admitted(repo, "dogs", 500.0, DAY1)
    assert job.credits_reserved == 0.0
    await repo.tenants.update("dogs", {"credits": 0.0}, actor="test", now=DAY1)
    assert await available(repo, "dogs") == 0.0
    await uses(repo, job.id, 1.0, DAY1)
    await repo.credits.settle(now=DAY1, half_life_s=600.0)
    assert await balance(repo, "dogs") == -1.0
    assert await ledger(repo, "dogs") == {CHARGE: -1.0}
    # Unlimited again: the debt goes with the balance, as an adjustment.
    await repo.tenants.update("dogs", {"credits": None}, actor="test", now=DAY1)
    assert await balance(repo, "dogs") is None
    assert await ledger(repo, "dogs") == {CHARGE: -1.0, ADJUST: 1.0}


async def test_a_daily_top_up_never_erases_a_debt(replicas: tuple[Repository, Repository]) -> None:
    """At -20 with 100 a day, the next day starts at 80 (it was 100)."""
    repo = replicas[0]
    await repo.tenants.create("owls", TenantTerms("free", credits=0.0, daily_credits=100.0), actor="test", now=DAY1)
    job = await admitted(repo, "owls", 50.0, DAY1)  # the day's 100 given first
    await uses(repo, job.id, 120.0, DAY1)  # more than it reserved
    await repo.credits.settle(now=DAY1, half_life_s=600.0)
    assert await balance(repo, "owls") == -20.0
    assert isinstance(await submit(repo, "owls", 0.0, DAY1), quotas.Refusal)  # in debt: nothing more today
    later = await admitted(repo, "owls", 10.0, DAY2)
    assert await balance(repo, "owls") == 80.0 and await available(repo, "owls") == 70.0
    await repo.jobs.request_cancel(later.id, tenant="owls", now=DAY2)
    await repo.credits.settle(now=DAY2, half_life_s=600.0)
    assert await balance(repo, "owls") == 80.0
    assert await ledger(repo, "owls") == {TOP_UP: 200.0, CHARGE: -120.0}


async def test_a_job_over_midnight_is_charged_once_and_refunds_nothing_past_the_cap(
    replicas: tuple[Repository, Repository],
) -> None:
    """A job holding 90 of 100 over midnight, with 100 a day: the day's top-up sees
    the balance (100, held or not) and gives nothing; the job's settlement
    releases its 90 and charges its 10 (it was 175: the top-up raised what was
    left to 100, and the 80 not used came back on top)."""
    repo = replicas[0]
    terms = TenantTerms("free", credits=100.0, daily_credits=100.0)
    await repo.tenants.create("bats", terms, actor="test", now=DAY1)
    night = DAY1.replace(hour=23, minute=50)
    first = await admitted(repo, "bats", 90.0, night)
    second = await admitted(repo, "bats", 5.0, DAY2.replace(hour=0, minute=10))
    assert await available(repo, "bats") == 5.0
    await uses(repo, first.id, 10.0, DAY2)
    await uses(repo, second.id, 5.0, DAY2)
    await repo.credits.settle(now=DAY2, half_life_s=600.0)
    assert await balance(repo, "bats") == 85.0
    assert await available(repo, "bats") == 85.0
    assert (await repo.jobs.get(first.id)).credits_charged == 10.0
    assert await ledger(repo, "bats") == {INITIAL: 100.0, CHARGE: -15.0}


async def test_added_credits_are_an_adjustment_of_a_limited_tenant_only(
    replicas: tuple[Repository, Repository],
) -> None:
    repo = replicas[0]
    await repo.tenants.create("cats", TenantTerms("free", credits=10.0), actor="test", now=DAY1)
    await repo.tenants.create("dogs", TenantTerms("free"), actor="test", now=DAY1)
    job = await admitted(repo, "cats", 8.0, DAY1)
    added = await repo.tenants.update("cats", {}, add_credits=25.0, actor="test", now=DAY1)
    assert added.terms.credits == 35.0 and await available(repo, "cats") == 27.0  # the 8 still held
    taken = await repo.tenants.update("cats", {"max_jobs": 3}, add_credits=-40.0, actor="test", now=DAY1)
    assert taken.terms.credits == -5.0 and taken.terms.max_jobs == 3
    with pytest.raises(InvalidArgument, match="no credit limit"):
        await repo.tenants.update("dogs", {"max_jobs": 3}, add_credits=5.0, actor="test", now=DAY1)
    assert (await repo.tenants.get("dogs")).terms.max_jobs is None  # nothing of it done
    with pytest.raises(ValueError, match="not both"):
        await repo.tenants.update("cats", {"credits": 1.0}, add_credits=5.0, actor="test", now=DAY1)
    await uses(repo, job.id, 2.0, DAY1)
    await repo.credits.settle(now=DAY1, half_life_s=600.0)
    assert await balance(repo, "cats") == -7.0
    entries = await repo.credits.entries("cats")
    assert [(e.kind, e.amount, e.job_id) for e in entries] == [
        (CHARGE, -2.0, job.id),
        (ADJUST, -40.0, None),
        (ADJUST, 25.0, None),
        (INITIAL, 10.0, None),
    ]
    actions = [a.detail for a in await repo.tenants.actions("cats")]
    assert actions[:2] == ["max_jobs=3, add_credits=-40.0", "add_credits=25.0"]


async def test_the_ledger_holds_under_concurrent_submits_settlements_and_adjustments(
    replicas: tuple[Repository, Repository],
) -> None:
    """Two replicas at once: settling in small batches, adding credits, submitting.
    Every move is an entry, and none is lost to a race."""
    a, b = replicas
    now = datetime.now(UTC)
    await a.tenants.create("cats", TenantTerms("free", credits=1000.0), actor="test", now=now)
    jobs = [await admitted(a, "cats", 20.0, now) for _ in range(24)]
    for i, job in enumerate(jobs):
        await uses(a, job.id, float(i % 7), now)

    async def settle(repo: Repository) -> None:
        while (await repo.credits.settle(now=now, half_life_s=600.0, limit=2)).jobs:
            pass

    async def add() -> None:
        for _ in range(8):
            await a.tenants.update("cats", {}, add_credits=5.0, actor="test", now=now)

    async def more() -> list[JobRecord | quotas.Refusal]:
        return [await submit(b, "cats", 3.0, now) for _ in range(8)]

    *_, submitted = await asyncio.gather(settle(a), settle(b), add(), more())
    assert all(not isinstance(s, quotas.Refusal) for s in submitted)
    await settle(a)
    used = sum(float(i % 7) for i in range(24))
    assert await balance(a, "cats") == 1000.0 + 40.0 - used
    assert await a.credits.held(["cats"]) == {"cats": 8 * 3.0}  # the new ones, still queued
    assert await ledger(a, "cats") == {INITIAL: 1000.0, ADJUST: 40.0, CHARGE: -used}


# -- the command -------------------------------------------------------------------


@pytest.fixture
def database(postgres: EmbeddedPostgres, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    url = fresh_database(postgres)
    monkeypatch.setenv("DARKROOM_DATABASE_URL", url)
    yield url


def darkroom(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from services.ops.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_sets_adds_and_shows_credits(database: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = darkroom(capsys, "tenants", "create", "cats", "--lane", "free", "--credits", "100")
    assert code == 0 and "credits 100 (0 held by open jobs, 100 available)" in out
    code, out, _ = darkroom(capsys, "tenants", "update", "cats", "--add-credits", "-30")
    assert code == 0 and "credits 70 (0 held by open jobs, 70 available)" in out
    code, out, _ = darkroom(capsys, "tenants", "update", "cats", "--add-credits", "5.5")
    assert code == 0 and "credits 75.5 " in out
    code, _, err = darkroom(capsys, "tenants", "update", "cats", "--credits", "3", "--add-credits", "5")
    assert code == 2 and "give one of them" in err
    darkroom(capsys, "tenants", "create", "dogs", "--lane", "free")
    code, _, err = darkroom(capsys, "tenants", "update", "dogs", "--add-credits", "5")
    assert code == 2 and "no credit limit" in err
    code, out, _ = darkroom(capsys, "tenants", "update", "cats", "--credits", "10")
    assert code == 0 and "credits 10 (0 held by open jobs, 10 available)" in out
    code, out, _ = darkroom(capsys, "tenants", "show", "cats")
    entries = [line.split(" ", 2)[2] for line in out.splitlines() if line.startswith("credits ")]
    assert entries == ["adjust -65.5", "adjust +5.5", "adjust -30", "initial +100"]
    assert "tenants update: add_credits=-30.0" in out


# -- the property ------------------------------------------------------------------


@dataclass
class Account:
    """What the model says of one tenant's credits, and where they came from."""

    balance: float | None
    daily: float | None
    day: date | None = None
    initial: float = 0.0
    top_ups: float = 0.0
    adjustments: float = 0.0
    charges: float = 0.0


@dataclass
class Job:
    tenant: str
    reserved: float
    day: date
    used: float = 0.0
    ended: bool = False
    settled: bool = False


@dataclass
class Model:
    accounts: dict[str, Account]
    jobs: dict[str, Job] = field(default_factory=dict)

    def held(self, tenant: str) -> float:
        return sum(j.reserved for j in self.jobs.values() if j.tenant == tenant and not j.settled)

    def open(self) -> list[str]:
        return [job_id for job_id, job in self.jobs.items() if not job.ended]

    def settle(self) -> None:
        """Every ended job: what it held released, what it used charged to a balance."""
        for job in self.jobs.values():
            if job.ended and not job.settled:
                job.settled = True
                account = self.accounts[job.tenant]
                if account.balance is not None:
                    account.balance -= job.used
                    account.charges += job.used


AMOUNT = st.integers(0, 100).map(float)
TENANT = st.integers(0, 1)
SUBMIT = st.tuples(st.just("submit"), TENANT, st.integers(0, 40).map(float))
END = st.tuples(
    st.just("end"),
    st.integers(0, 30),  # which of the open jobs
    st.integers(0, 60).map(float),  # what it used
    st.sampled_from(["succeeds", "fails", "gpu fault", "cancelled"]),
)
SETTLE = st.tuples(st.just("settle"))
# Submits, ends and settlements more often than the operator and the clock.
STEP = st.one_of(
    SUBMIT,
    SUBMIT,
    END,
    END,
    SETTLE,
    st.tuples(st.just("set"), TENANT, st.none() | AMOUNT),
    st.tuples(st.just("add"), TENANT, st.integers(-60, 60).map(float)),
    st.tuples(st.just("midnight"), st.integers(0, 23)),
)
_examples = itertools.count()


@settings(
    max_examples=150,
    derandomize=True,  # the same run each time
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    # The first tenant starts with a limit, the second may not.
    credits=st.tuples(AMOUNT, st.none() | AMOUNT),
    daily=st.tuples(AMOUNT | st.none(), st.none() | AMOUNT),
    steps=st.lists(STEP, min_size=5, max_size=40),
)
async def test_the_ledger_is_exact_over_any_interleaving(
    replicas: tuple[Repository, Repository],
    credits: tuple[float | None, float | None],
    daily: tuple[float | None, float | None],
    steps: list[tuple[Any, ...]],
) -> None:
    """Submits, jobs ending (succeeded, failed, a GPU's fault, cancelled) having
    used any amount, settlements, operator changes and midnights, in any order:
    after each, every tenant's balance is what the model says, and is its
    initial credits + top-ups + adjustments - charges, each of them as its ledger
    records it; what is held is exactly its unsettled jobs' reservations (none for
    a tenant without a limit); a settlement never raises a balance. Tenants are
    new to each example; the database is shared."""
    repo = replicas[0]
    example = next(_examples)
    names = [f"p{example}-{i}" for i in range(2)]
    clock = DAY1
    model = Model({})
    for name, limit, day_credits in zip(names, credits, daily, strict=True):
        await repo.tenants.create(name, TenantTerms("free", limit, day_credits), actor="test", now=clock)
        model.accounts[name] = Account(limit, day_credits, initial=limit or 0.0)

    async def check() -> None:
        held = await repo.credits.held(names)
        for name, account in model.accounts.items():
            assert await balance(repo, name) == account.balance
            assert held[name] == model.held(name)
            kinds = await ledger(repo, name)
            recorded = (
                kinds.get(INITIAL, 0.0),
                kinds.get(TOP_UP, 0.0),
                kinds.get(ADJUST, 0.0),
                -kinds.get(CHARGE, 0.0),
            )
            assert recorded == (account.initial, account.top_ups, account.adjustments, account.charges)
            assert (account.balance or 0.0) == account.initial + account.top_ups + account.adjustments - account.charges

    for step in steps:
        kind = step[0]
        if kind == "submit":
            name, cost = names[step[1]], step[2]
            account = model.accounts[name]
            if account.balance is not None and account.daily is not None and account.day != clock.date():
                # The day's credits: up to the daily amount, to at most it; a debt paid first.
                topped = max(0.0, account.daily - max(account.balance, 0.0))
                event("a top-up of a debt" if account.balance < 0 else "a top-up")
                account.balance += topped
                account.top_ups += topped
                account.day = clock.date()
            let_in = account.balance is None or account.balance - model.held(name) >= cost
            job = await submit(repo, name, cost, clock)
            assert (not isinstance(job, quotas.Refusal)) == let_in, (job, account)
            if isinstance(job, JobRecord):
                reserved = cost if account.balance is not None else 0.0
                assert job.credits_reserved == reserved
                model.jobs[job.id] = Job(name, reserved, clock.date())
        elif kind == "end" and model.open():
            job_id = model.open()[step[1] % len(model.open())]
            used, outcome = step[2], step[3]
            attempt = await running(repo, job_id)
            if outcome == "succeeds":
                await uses(repo, job_id, used, clock)
            elif outcome == "fails":  # its own fault: charged
                await repo.attempts.fail(job_id, attempt, "w1", "bad", retryable=False, now=clock, gpu_seconds=used)
            elif outcome == "cancelled":
                assert await repo.attempts.cancel(job_id, attempt, "w1", now=clock, gpu_seconds=used)
            else:  # the GPU's fault: back to the queue, not charged
                status = await repo.attempts.fail(
                    job_id, attempt, "w1", "CUDA error", retryable=True, now=clock, gpu_seconds=used
                )
                assert status == JobStatus.QUEUED
                continue
            model.jobs[job_id].used += used
            model.jobs[job_id].ended = True
            event("a job used more than it reserved" if used > model.jobs[job_id].reserved else "a job ended")
        elif kind == "settle":
            before = {name: await balance(repo, name) for name in names}
            await repo.credits.settle(now=clock, half_life_s=600.0)
            if any(j.ended and not j.settled and j.day != clock.date() for j in model.jobs.values()):
                event("a job settled on a later day than it was submitted")
            model.settle()
            for name in names:
                was, now = before[name], await balance(repo, name)
                assert was is None or now is None or now <= was  # never a refund
        elif kind == "set":
            name, value = names[step[1]], step[2]
            account = model.accounts[name]
            await repo.tenants.update(name, {"credits": value}, actor="test", now=clock)
            account.adjustments += (value or 0.0) - (account.balance or 0.0)
            account.balance = value
        elif kind == "add":
            name, amount = names[step[1]], step[2]
            account = model.accounts[name]
            if account.balance is None:
                with pytest.raises(InvalidArgument):
                    await repo.tenants.update(name, {}, add_credits=amount, actor="test", now=clock)
            else:
                await repo.tenants.update(name, {}, add_credits=amount, actor="test", now=clock)
                account.balance += amount
                account.adjustments += amount
        elif kind == "midnight":
            clock = datetime.combine(clock.date() + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
            clock += timedelta(hours=step[1])
        await check()
    # Everything that ended settles; what the still open jobs hold stays held.
    await repo.credits.settle(now=clock, half_life_s=600.0)
    model.settle()
    await check()
