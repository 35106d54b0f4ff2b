"""Which submits a tenant's limits let in: pure, over what the submit's transaction
read of each tenant (its row locked, so every gateway replica decides on the same
figures in turn), with the clock passed in.

``max_jobs`` caps the tenant's jobs queued or running; ``rate_per_s`` is a token
bucket holding at most one second of submits (at least one), shared by every
gateway because its state lives on the tenant's row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

MAX_JOBS = "max_jobs"
RATE = "rate"


@dataclass(frozen=True)
class TenantLoad:
    """A tenant's limits and where it stands against them."""

    name: str
    max_jobs: int | None
    active: int  # its jobs queued or running
    rate_per_s: float | None
    tokens: float  # submits its bucket held at ``tokens_at``
    tokens_at: datetime | None  # None: never drawn on (a full bucket)

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
    limit: str  # MAX_JOBS or RATE
    description: str
    retry_after_s: float | None  # None: when one of its jobs ends, which only an estimate can say


def admit(
    loads: dict[str, TenantLoad], tenants: Sequence[str], now: datetime
) -> tuple[list[Refusal | None], dict[str, TenantLoad]]:
    """For submits by ``tenants``, in order: None for one let in, or why not; and the
    tenants' loads after them. A tenant without a load has no limits."""
    after = dict(loads)
    decisions: list[Refusal | None] = []
    for name in tenants:
        load = after.get(name)
        if load is None:
            decisions.append(None)
            continue
        if load.max_jobs is not None and load.active >= load.max_jobs:
            decisions.append(
                Refusal(name, MAX_JOBS, f"tenant {name!r} has {load.active} of its {load.max_jobs} jobs", None)
            )
            continue
        tokens = load.tokens_now(now)
        if load.rate_per_s is not None:
            if tokens < 1.0:
                wait = (1.0 - tokens) / load.rate_per_s
                decisions.append(Refusal(name, RATE, f"tenant {name!r} submits {load.rate_per_s:g}/s at most", wait))
                continue
            tokens -= 1.0
        after[name] = replace(load, active=load.active + 1, tokens=tokens, tokens_at=now)
        decisions.append(None)
    return decisions, after
