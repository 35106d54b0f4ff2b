"""A tenant's limits (``services.quotas``) as the gateway applies them: which
callers have any, and a refusal as the caller hears it, RESOURCE_EXHAUSTED with a
QuotaFailure naming the tenant and the limit and a RetryInfo where anything but an
operator frees it. Counted, not logged: a client at its limit would fill the log.
A submit's costly work (its input image decoded, its prompt expanded) waits for a
read-only look at the limits, so a tenant past them costs no more than that look."""

from __future__ import annotations

from datetime import datetime

from gateway.auth import Caller
from gateway.metrics import count_refusal, count_submit
from services import quotas
from services.db.repository.admission import Admission
from services.db.tenant_records import TenantTerms
from services.errors import QuotaViolation, ResourceExhausted


def limited(terms: TenantTerms | None) -> bool:
    """Whether a caller of these terms has any limit (None: no record, no limits)."""
    return terms is not None and (terms.max_jobs, terms.rate_per_s, terms.credits) != (None, None, None)


def refused(refusal: quotas.Refusal, run_s: float | None) -> ResourceExhausted:
    """The error for ``refusal``, counted; ``run_s``: about one job's run, when a
    place frees under ``max_jobs`` (None where no job is asked for)."""
    count_refusal(refusal.limit, refusal.tenant)
    retry_s = refusal.retry_after_s
    if retry_s is None and refusal.limit == quotas.MAX_JOBS:
        retry_s = max(1.0, run_s or 1.0)
    when = f"retry in {retry_s:.1f}s" if retry_s is not None else "its daily credits do not cover it"
    return ResourceExhausted(
        f"{refusal.description}; {when}",
        retry_after_s=retry_s,
        quota=QuotaViolation(f"tenant:{refusal.tenant}", f"{refusal.limit}: {refusal.description}"),
    )


async def look_first(
    admission: Admission, caller: Caller, lane: str, cost: float, now: datetime, run_s: float | None
) -> None:
    """ResourceExhausted (a refused submit, counted) where ``caller``'s tenant's
    limits would keep out a job in ``lane`` costing ``cost`` credits now (0 where
    its estimate is not known yet: then only a tenant in debt is short); nothing for
    a caller without limits. Read-only: the submit's transaction decides, and draws."""
    if not limited(caller.terms):
        return
    refusal = await admission.refusal(caller.tenant, cost, now)
    if refusal is not None:
        count_submit(lane, caller.tenant, "refused")
        raise refused(refusal, run_s)
