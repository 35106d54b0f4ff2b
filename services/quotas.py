"""Which submits a tenant's limits let in: pure, over what the submit's transaction
read of each tenant (its row locked, so every gateway replica decides on the same
figures in turn), with the clock passed in.

``max_jobs`` caps the tenant's jobs queued or running; ``rate_per_s`` is a token
bucket holding at most one second of calls (at least one): submits, and
moderations, which cost it nothing else; shared by every gateway because its
state lives on the tenant's row.

``credits`` is a ledger of GPU-seconds times the model's price
(docs/operations.md#credits). The *balance* moves only by entries: an operator's
adjustment, a daily top-up, a settled job's charge. A job let in *holds* its
estimated cost apart from the balance until it is settled; a submit is let in if
what is *available*, the balance less what its tenant's open jobs hold, covers its
estimate. A tenant without a credit limit holds nothing. Daily credits raise the
balance once per UTC day by at most their amount, to at most their amount, and a
debt is paid out of them first (-20 with 100 a day becomes 80): never forgiven."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta

from services.db.adapter_records import MAX_ADAPTER_MB, MAX_ADAPTERS, AdapterLimits, AdapterRefusal, AdapterUsage

MAX_JOBS = "max_jobs"
RATE = "rate"
CREDITS = "credits"


def top_up(balance: float | None, daily: float | None, day: date | None, today: date) -> float:
    """What ``today``'s daily credits add to the balance: nothing if they were given
    on ``day`` already (or there is no balance, or no daily credits); else up to
    ``daily``, to at most ``daily``. What the tenant's open jobs hold is part of the
    balance: a job running over midnight is not paid for twice. A balance below
    zero gets the whole daily amount, which pays the debt first."""
    if balance is None or daily is None or day == today:
        return 0.0
    return max(0.0, daily - max(balance, 0.0))


def refilled(
    credits: float | None, daily: float | None, day: date | None, today: date
) -> tuple[float | None, date | None]:
    """The balance and its refill day once ``today``'s daily credits are given."""
    if credits is None or daily is None or day == today:
        return credits, day
    return credits + top_up(credits, daily, day, today), today


def available(balance: float | None, held: float) -> float | None:
    """What a tenant may still reserve: its balance less what its open jobs hold
    (below zero while it is in debt); None: no limit."""
    return None if balance is None else balance - held


def next_refill_s(now: datetime) -> float:
    """Seconds until the next UTC day begins."""
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), tzinfo=now.tzinfo)
    return (midnight - now).total_seconds()


@dataclass(frozen=True)
class TenantLoad:
    """A tenant's limits and where it stands against them."""

    name: str
    max_jobs: int | None
    active: int  # its jobs queued or running
    rate_per_s: float | None
    tokens: float  # submits its bucket held at ``tokens_at``
    tokens_at: datetime | None  # None: never drawn on (a full bucket)
    credits: float | None = None  # its balance; None: no limit
    daily_credits: float | None = None
    credits_day: date | None = None  # the UTC day its daily credits were last given
    held: float = 0.0  # what its open (unsettled) jobs hold of the balance
    topped_up: float = 0.0  # what today's daily credits added to the balance here

    @property
    def burst(self) -> float:
        return max(1.0, self.rate_per_s or 0.0)

    def tokens_now(self, now: datetime) -> float:
        if self.rate_per_s is None or self.tokens_at is None:
            return self.burst
        elapsed = max(0.0, (now - self.tokens_at).total_seconds())
        return min(self.burst, self.tokens + elapsed * self.rate_per_s)


@dataclass(frozen=True)
class Refusal:
    tenant: str
    limit: str  # MAX_JOBS, RATE or CREDITS
    description: str
    # None: for MAX_JOBS, when one of its jobs ends, which only an estimate can
    # say; for CREDITS, never by itself (no daily credits cover the job).
    retry_after_s: float | None


def admit(
    loads: dict[str, TenantLoad], submits: Sequence[tuple[str, float]], now: datetime
) -> tuple[list[Refusal | None], dict[str, TenantLoad]]:
    """For submits, each by a tenant at an estimated cost in credits, in order: None
    for one let in, or why not; and the tenants' loads after them (today's daily
    credits given, and the costs of those let in held apart from their balances).
    A tenant without a load has no limits."""
    after = {name: _refilled(load, now.date()) for name, load in loads.items()}
    decisions: list[Refusal | None] = []
    for name, cost in submits:
        load = after.get(name)
        if load is None:
            decisions.append(None)
            continue
        if load.max_jobs is not None and load.active >= load.max_jobs:
            decisions.append(
                Refusal(name, MAX_JOBS, f"tenant {name!r} has {load.active} of its {load.max_jobs} jobs", None)
            )
            continue
        drawn = draw(load, now)
        if isinstance(drawn, Refusal):
            decisions.append(drawn)
            continue
        have = available(load.credits, load.held)
        if have is not None and have < cost:
            decisions.append(_short(load, have, cost, now))
            continue
        held = load.held + reservation(load, cost)
        after[name] = replace(drawn, active=load.active + 1, held=held)
        decisions.append(None)
    return decisions, after


def draw(load: TenantLoad, now: datetime) -> TenantLoad | Refusal:
    """``load`` with one call drawn from its rate bucket (a submit's, or a
    moderation's, which costs nothing else), or why not; a load without a rate
    limit as it is."""
    if load.rate_per_s is None:
        return load
    tokens = load.tokens_now(now)
    if tokens < 1.0:
        wait = (1.0 - tokens) / load.rate_per_s
        about = f"tenant {load.name!r} makes {load.rate_per_s:g} calls a second at most (submits and moderations)"
        return Refusal(load.name, RATE, about, wait)
    return replace(load, tokens=tokens - 1.0, tokens_at=now)


def reservation(load: TenantLoad | None, cost: float) -> float:
    """What a job let in at an estimated ``cost`` holds of its tenant's credits: the
    cost, or nothing for a tenant without a credit limit (or without a load)."""
    return cost if load is not None and load.credits is not None else 0.0


def _refilled(load: TenantLoad, today: date) -> TenantLoad:
    if load.credits is None or load.daily_credits is None or load.credits_day == today:
        return load
    amount = top_up(load.credits, load.daily_credits, load.credits_day, today)
    return replace(load, credits=load.credits + amount, credits_day=today, topped_up=amount)


def _short(load: TenantLoad, have: float, cost: float, now: datetime) -> Refusal:
    have = max(0.0, have)
    description = f"tenant {load.name!r} has {have:.1f} credits left and the job needs about {cost:.1f}"
    if load.daily_credits is not None and load.daily_credits >= cost:
        return Refusal(load.name, CREDITS, description, next_refill_s(now))
    return Refusal(load.name, CREDITS, description, None)


def adapter_room(tenant: str, size: int, usage: AdapterUsage, limits: AdapterLimits) -> AdapterRefusal | None:
    """Why ``tenant``, keeping ``usage`` of its own adapters, may not keep one more of
    ``size`` bytes under ``limits``; None where it may."""
    if usage.adapters + 1 > limits.max_adapters:
        why = f"{usage.adapters} adapter versions kept, of at most {limits.max_adapters}: remove one first"
        return AdapterRefusal(tenant, MAX_ADAPTERS, why)
    if usage.size_bytes + size > limits.max_bytes:
        why = (
            f"{usage.size_bytes / 2**20:.1f} MiB of adapters kept and {size / 2**20:.1f} MiB more asked, "
            f"of at most {limits.max_bytes / 2**20:.1f} MiB"
        )
        return AdapterRefusal(tenant, MAX_ADAPTER_MB, why)
    return None
