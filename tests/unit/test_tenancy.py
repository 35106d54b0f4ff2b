"""Tenancy's pure parts: API keys made and matched, ListJobs page tokens, the lane a
tenant may ask for, and the gatekeeper's decisions (over an in-memory table of
tenants: its own reads are the subject here, not PostgreSQL's)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gateway import pages
from gateway.auth import RECHECK_S, Gatekeeper
from gateway.validation import validate_submit
from services import api_keys, quotas
from services.db.records import JobCursor
from services.db.states import JobStatus
from services.db.tenant_records import DEFAULT_TENANT, KeyHolder, KeyRecord, TenantRecord, TenantTerms
from services.errors import InvalidArgument, PermissionDenied, Unauthenticated
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

NOW = datetime(2026, 11, 24, tzinfo=UTC)


def test_a_key_names_its_id_and_matches_only_its_digest() -> None:
    issued = api_keys.new_key()
    assert api_keys.key_id_of(issued.key) == issued.id
    assert api_keys.matches(issued.key, issued.digest)
    assert not api_keys.matches(issued.key + "x", issued.digest)
    assert issued.key not in issued.digest and len(issued.digest) == 64
    assert api_keys.new_key().key != issued.key
    for malformed in ("", "s3cret", "drk_", "drk_abc", "drk__secret", "drk_abc_"):
        assert api_keys.key_id_of(malformed) is None


def test_a_page_token_names_where_the_page_ended() -> None:
    cursor = JobCursor(datetime(2026, 11, 24, 3, 4, 5, 123456, tzinfo=UTC), "job-9")
    asked = pages.page_request(pb.ListJobsRequest(page_token=pages.encode(cursor), statuses=[pb.JOB_STATUS_QUEUED]))
    assert asked == pages.PageRequest(pages.DEFAULT_PAGE_SIZE, cursor, (JobStatus.QUEUED,))
    assert pages.page_request(pb.ListJobsRequest(page_size=10_000)).size == pages.MAX_PAGE_SIZE
    with pytest.raises(InvalidArgument) as err:
        pages.page_request(pb.ListJobsRequest(page_token="not a token", statuses=[pb.JOB_STATUS_UNSPECIFIED]))
    assert [v.field for v in err.value.violations] == ["page_token", "statuses"]


@pytest.mark.parametrize(
    ("tenant_lane", "asked", "lane"),
    [("free", "", "free"), ("paid", "", "paid"), ("paid", "free", "free"), (None, "paid", "paid")],
)
def test_a_tenant_gets_its_lane_or_a_lower_one(tenant_lane: str | None, asked: str, lane: str) -> None:
    req = pb.SubmitJobRequest(model="tiny", prompt="x", lane=asked)
    job = validate_submit(
        req, ModelRegistry.load(), max_prompt_chars=100, now=NOW, tenant="cats", tenant_lane=tenant_lane
    )
    assert (job.lane, job.tenant) == (lane, "cats")


def test_a_lane_above_the_tenants_is_refused_by_name() -> None:
    req = pb.SubmitJobRequest(model="tiny", prompt="x", lane="paid")
    with pytest.raises(PermissionDenied, match="'paid'"):
        validate_submit(req, ModelRegistry.load(), max_prompt_chars=100, now=NOW, tenant="cats", tenant_lane="free")


# -- the gatekeeper ------------------------------------------------------------------


@dataclass
class Table:
    """Tenants and keys as the gatekeeper reads them, counting its reads."""

    tenants: dict[str, TenantRecord] = field(default_factory=dict)
    holders: dict[str, KeyHolder] = field(default_factory=dict)
    reads: int = 0

    async def holder(self, key_id: str) -> KeyHolder | None:
        self.reads += 1
        return self.holders.get(key_id)

    async def find(self, name: str) -> TenantRecord | None:
        self.reads += 1
        return self.tenants.get(name)

    async def any(self) -> bool:
        self.reads += 1
        return bool(self.tenants)

    def add(self, name: str, lane: str, *, admin: bool = False) -> str:
        tenant = self.tenants[name] = TenantRecord(name, TenantTerms(lane), NOW, NOW)
        issued = api_keys.new_key()
        self.holders[issued.id] = KeyHolder(KeyRecord(issued.id, name, admin, NOW), issued.digest, tenant)
        return issued.key


class Context:
    def __init__(self, key: str | None) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:10.0.0.7:5555"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def call(gate: Gatekeeper, key: str | None):  # type: ignore[no-untyped-def]
    return asyncio.run(gate.caller(Context(key), "GetJob"))  # type: ignore[arg-type]


def test_without_tenants_or_keys_everyone_is_the_default_tenant() -> None:
    gate = Gatekeeper(Table(), (), clock=Clock())  # type: ignore[arg-type]
    for key in (None, "anything"):
        caller = call(gate, key)
        assert (caller.tenant, caller.admin, caller.terms) == (DEFAULT_TENANT, True, None)


def test_keys_of_the_environment_are_the_default_tenants_and_close_the_gateway() -> None:
    table = Table()
    gate = Gatekeeper(table, ["s3cret"], clock=Clock())  # type: ignore[arg-type]
    assert call(gate, "s3cret").tenant == DEFAULT_TENANT
    with pytest.raises(Unauthenticated):
        call(gate, None)
    table.add(DEFAULT_TENANT, "paid")  # made with the CLI: its terms apply to those keys
    gate = Gatekeeper(table, ["s3cret"], clock=Clock())  # type: ignore[arg-type]
    assert call(gate, "s3cret").terms == TenantTerms("paid")


def test_a_tenants_key_is_its_tenant_and_a_wrong_one_is_refused() -> None:
    table = Table()
    cats = table.add("cats", "free")
    dogs = table.add("dogs", "paid", admin=True)
    gate = Gatekeeper(table, (), clock=Clock())  # type: ignore[arg-type]
    assert (call(gate, cats).tenant, call(gate, cats).admin) == ("cats", False)
    assert (call(gate, dogs).tenant, call(gate, dogs).admin) == ("dogs", True)
    for wrong in (None, "", cats + "x", cats.replace("drk_", "drk_0"), "drk_ffff_secret"):
        with pytest.raises(Unauthenticated, match="Bearer"):
            call(gate, wrong)


def test_a_revocation_is_seen_once_the_key_is_read_again() -> None:
    table = Table()
    cats = table.add("cats", "free")
    clock = Clock()
    gate = Gatekeeper(table, (), clock=clock)  # type: ignore[arg-type]
    assert call(gate, cats).tenant == "cats"
    reads = table.reads
    for _ in range(100):  # remembered: no read per call
        call(gate, cats)
    assert table.reads == reads
    key_id = api_keys.key_id_of(cats)
    assert key_id is not None
    held = table.holders[key_id]
    table.holders[key_id] = KeyHolder(KeyRecord(key_id, "cats", False, NOW, revoked_at=NOW), held.digest, held.tenant)
    clock.now += RECHECK_S
    with pytest.raises(Unauthenticated):
        call(gate, cats)


# -- limits ------------------------------------------------------------------------


def load(**fields: Any) -> quotas.TenantLoad:
    values: dict[str, Any] = {
        "name": "cats",
        "max_jobs": None,
        "active": 0,
        "rate_per_s": None,
        "tokens": 0.0,
        "tokens_at": None,
    }
    return quotas.TenantLoad(**{**values, **fields})


def by(tenant: str, cost: float = 1.0) -> list[tuple[str, float]]:
    return [(tenant, cost)]


def test_max_jobs_lets_in_up_to_the_cap_and_counts_what_it_lets_in() -> None:
    decisions, after = quotas.admit({"cats": load(max_jobs=3, active=1)}, by("cats") * 4 + by("dogs"), NOW)
    assert [d.limit if d else None for d in decisions] == [None, None, quotas.MAX_JOBS, quotas.MAX_JOBS, None]
    assert after["cats"].active == 3 and decisions[2] is not None and decisions[2].retry_after_s is None


def test_the_rate_bucket_holds_a_second_of_submits_and_refills() -> None:
    decisions, after = quotas.admit({"cats": load(rate_per_s=2.0)}, by("cats") * 3, NOW)
    assert [d is None for d in decisions] == [True, True, False]
    refusal = decisions[2]
    assert refusal is not None and refusal.limit == quotas.RATE and refusal.retry_after_s == pytest.approx(0.5)
    later = NOW + timedelta(seconds=0.5)
    decisions, after = quotas.admit(after, by("cats") * 2, later)
    assert [d is None for d in decisions] == [True, False]
    slow = load(rate_per_s=0.1)  # a bucket of at least one submit
    decisions, _ = quotas.admit({"cats": slow}, by("cats") * 2, NOW)
    assert decisions[0] is None and decisions[1] is not None
    assert decisions[1].retry_after_s == pytest.approx(10.0)


def test_credits_hold_each_job_s_estimate_and_refuse_what_they_cannot_cover() -> None:
    # A balance of 12 with 2 held by an open job: 10 available.
    decisions, after = quotas.admit({"cats": load(credits=12.0, held=2.0)}, by("cats", 4.0) * 3 + by("cats", 2.0), NOW)
    assert [d is None for d in decisions] == [True, True, False, True]
    # Held apart: the balance is untouched until the jobs are settled.
    assert after["cats"].credits == 12.0 and after["cats"].held == pytest.approx(12.0) and after["cats"].active == 3
    refusal = decisions[2]
    assert refusal is not None and refusal.limit == quotas.CREDITS and refusal.retry_after_s is None
    assert "2.0 credits left" in refusal.description and "about 4.0" in refusal.description


def test_a_tenant_without_a_credit_limit_holds_nothing() -> None:
    decisions, after = quotas.admit({"cats": load(max_jobs=5)}, by("cats", 500.0) + by("dogs", 500.0), NOW)
    assert decisions == [None, None] and after["cats"].held == 0.0 and "dogs" not in after
    assert quotas.reservation(after["cats"], 500.0) == 0.0 and quotas.reservation(None, 500.0) == 0.0
    assert quotas.reservation(load(credits=0.0), 500.0) == 500.0


def test_a_debt_refuses_every_job_until_it_is_paid() -> None:
    decisions, _ = quotas.admit({"cats": load(credits=-3.0)}, by("cats", 0.5), NOW)
    assert decisions[0] is not None and "0.0 credits left" in decisions[0].description
    assert quotas.available(-3.0, 1.0) == -4.0 and quotas.available(None, 1.0) is None


def test_daily_credits_top_the_balance_up_once_a_day_and_never_beyond() -> None:
    yesterday = NOW.date() - timedelta(days=1)
    short = load(credits=1.0, daily_credits=5.0, credits_day=yesterday)
    decisions, after = quotas.admit({"cats": short}, by("cats", 3.0) * 2, NOW)
    assert [d is None for d in decisions] == [True, False]
    assert after["cats"].credits == 5.0 and after["cats"].topped_up == 4.0 and after["cats"].held == 3.0
    assert after["cats"].credits_day == NOW.date()
    refusal = decisions[1]
    # The next refill covers it: at the next UTC midnight.
    midnight = datetime.combine(NOW.date() + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
    assert refusal is not None and refusal.retry_after_s == pytest.approx((midnight - NOW).total_seconds())
    # Given once a day: the same day does not refill again.
    assert quotas.refilled(2.0, 5.0, NOW.date(), NOW.date()) == (2.0, NOW.date())
    assert quotas.admit(after, by("cats", 0.0), NOW)[1]["cats"].topped_up == 4.0  # not given again
    # A balance above the daily amount keeps what it has.
    assert quotas.refilled(8.0, 5.0, yesterday, NOW.date()) == (8.0, NOW.date())
    # No limit stays no limit.
    assert quotas.refilled(None, 5.0, yesterday, NOW.date()) == (None, yesterday)
    assert quotas.top_up(None, 5.0, yesterday, NOW.date()) == 0.0


@pytest.mark.parametrize(
    ("balance", "topped_up"),
    [(-20.0, 100.0), (-150.0, 100.0), (0.0, 100.0), (30.0, 70.0), (100.0, 0.0), (180.0, 0.0)],
)
def test_daily_credits_never_forgive_a_debt(balance: float, topped_up: float) -> None:
    """A debt is paid out of the day's credits (-20 with 100 a day becomes 80), and
    what open jobs hold counts as the balance's: held or not, the same top-up."""
    yesterday = NOW.date() - timedelta(days=1)
    assert quotas.top_up(balance, 100.0, yesterday, NOW.date()) == topped_up
    assert quotas.refilled(balance, 100.0, yesterday, NOW.date()) == (balance + topped_up, NOW.date())
    _, after = quotas.admit({"cats": load(credits=balance, held=90.0, daily_credits=100.0)}, [], NOW)
    assert (after["cats"].credits, after["cats"].topped_up, after["cats"].held) == (
        balance + topped_up,
        topped_up,
        90.0,
    )


def test_a_refused_submit_spends_neither_credits_nor_a_rate_token() -> None:
    decisions, after = quotas.admit({"cats": load(credits=1.0, rate_per_s=5.0)}, by("cats", 2.0), NOW)
    assert decisions[0] is not None and decisions[0].limit == quotas.CREDITS
    assert after["cats"].credits == 1.0 and after["cats"].held == 0.0 and after["cats"].tokens_at is None


def test_a_moderation_draws_on_the_rate_bucket_alone() -> None:
    """A moderation costs a call of the tenant's rate, as a submit does, and nothing
    else: no job counted, no credits held, even past them."""
    spent = quotas.draw(load(rate_per_s=2.0, max_jobs=0, credits=-5.0), NOW)
    assert isinstance(spent, quotas.TenantLoad)
    assert spent.tokens == pytest.approx(1.0) and spent.tokens_at == NOW and spent.active == 0 and spent.held == 0.0
    empty = quotas.draw(spent, NOW)
    assert isinstance(empty, quotas.TenantLoad)
    refused = quotas.draw(empty, NOW)
    assert isinstance(refused, quotas.Refusal) and refused.limit == quotas.RATE
    assert refused.retry_after_s == pytest.approx(0.5)
    # A submit and a moderation share the bucket: one second of calls.
    decisions, _ = quotas.admit({"cats": replace(empty, max_jobs=None, credits=None)}, by("cats"), NOW)
    assert decisions[0] is not None and decisions[0].limit == quotas.RATE
    unlimited = load(max_jobs=0)
    assert quotas.draw(unlimited, NOW) == unlimited
