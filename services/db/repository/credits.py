"""Tenants' credit ledgers, and settling what ended jobs cost.

A tenant's balance (``tenants.credits``) moves only with an entry of its ledger
(``credit_entries``), in the same statement or transaction: an operator's
adjustment (``tenants``), a daily top-up (``admission``), a settled job's charge
(here). What its open jobs reserved is held apart: the sum of their
``credits_reserved`` until they are settled, never taken from the balance, so a
settlement releases exactly what the job held and charges exactly what it used.

Settling an ended job, once, by whichever scheduler replica gets to it first:
its tenant's balance is charged its cost (if the tenant has a balance), its
reservation released, its usage of the day counted, and its GPU-seconds added to
its tenant's fair share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.repository.database import Area, fetch_all
from services.db.tenant_records import CHARGE, CreditEntry, OpenJobs, TenantShare

_ENDED = """
SELECT id, tenant, credits_reserved, gpu_seconds, gpu_seconds * price AS charged,
       (coalesce(finished_at, %(now)s) AT TIME ZONE 'UTC')::date AS day
FROM jobs
WHERE settled_at IS NULL AND status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'EXPIRED')
ORDER BY finished_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""
# Each charge an entry of the ledger of a tenant with a balance, and the balance
# moved by them, in one statement: the two never disagree. Tenants without a
# credit limit are charged nothing (their usage is counted all the same).
_CHARGE = f"""
WITH charges AS (
    INSERT INTO credit_entries (tenant, at, kind, amount, job_id)
    SELECT c.tenant, %(now)s, '{CHARGE}', -c.charged, c.id
    FROM unnest(%(ids)s::varchar[], %(tenants)s::varchar[], %(charged)s::float8[]) AS c(id, tenant, charged)
    JOIN tenants t ON t.name = c.tenant AND t.credits IS NOT NULL
    WHERE c.charged <> 0
    RETURNING tenant, amount
)
UPDATE tenants t SET credits = t.credits + s.amount
FROM (SELECT tenant, sum(amount) AS amount FROM charges GROUP BY tenant) AS s
WHERE t.name = s.tenant
"""
# Jobs hold their reservations until they are settled, ended or not.
_OPEN_JOBS = """
SELECT tenant,
       count(*) FILTER (WHERE status IN ('QUEUED', 'SCHEDULED', 'RUNNING', 'DECODING')) AS active,
       coalesce(sum(credits_reserved), 0) AS held
FROM jobs WHERE tenant = ANY(%s) AND settled_at IS NULL
GROUP BY tenant
"""
_RECORD = """
INSERT INTO credit_entries (tenant, at, kind, amount, job_id)
SELECT * FROM unnest(%s::varchar[], %s::timestamptz[], %s::varchar[], %s::float8[], %s::varchar[])
"""
_USAGE = """
INSERT INTO tenant_usage (tenant, day, jobs, gpu_seconds, credits)
SELECT tenant, day, count(*), sum(gpu_seconds), sum(charged)
FROM unnest(%s::varchar[], %s::date[], %s::float8[], %s::float8[]) AS u(tenant, day, gpu_seconds, charged)
GROUP BY tenant, day
ON CONFLICT (tenant, day) DO UPDATE SET
    jobs = tenant_usage.jobs + excluded.jobs,
    gpu_seconds = tenant_usage.gpu_seconds + excluded.gpu_seconds,
    credits = tenant_usage.credits + excluded.credits
"""

# What was used counts half per half-life (``scheduler.fair_share.decayed``, here
# in SQL so that two replicas settling at once add up under the row's lock).
_SHARES = """
INSERT INTO tenant_shares AS s (tenant, used_s, used_at)
SELECT tenant, used_s, %(now)s FROM unnest(%(tenants)s::varchar[], %(used)s::float8[]) AS u(tenant, used_s)
ON CONFLICT (tenant) DO UPDATE SET
    used_s = s.used_s * power(0.5, greatest(extract(epoch FROM excluded.used_at - s.used_at), 0) / %(half_life_s)s)
             + excluded.used_s,
    used_at = greatest(s.used_at, excluded.used_at)
"""
_READ_SHARES = """
SELECT coalesce(t.name, s.tenant) AS tenant, coalesce(t.weight, 1) AS weight,
       coalesce(s.used_s, 0) AS used_s, s.used_at
FROM tenants t FULL JOIN tenant_shares s ON s.tenant = t.name
ORDER BY 1
"""


@dataclass(frozen=True)
class Settled:
    """What one settlement charged, per tenant: GPU-seconds and credits."""

    jobs: int = 0
    gpu_seconds: dict[str, float] = field(default_factory=dict)
    credits: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class DayUsage:
    jobs: int = 0
    gpu_seconds: float = 0.0
    credits: float = 0.0


async def open_jobs(conn: AsyncConnection[DictRow], tenants: Sequence[str]) -> dict[str, OpenJobs]:
    """Each of these tenants' jobs not yet settled: how many are active, what they hold."""
    rows = await fetch_all(conn, _OPEN_JOBS, (list(tenants),))
    return {r["tenant"]: OpenJobs(r["active"], r["held"]) for r in rows}


async def record(conn: AsyncConnection[DictRow], entries: Sequence[CreditEntry]) -> None:
    """Writes entries of tenants' ledgers; the caller moves their balances with them,
    in the same transaction."""
    if entries:
        columns = ([e.tenant for e in entries], [e.at for e in entries], [e.kind for e in entries])
        await conn.execute(_RECORD, (*columns, [e.amount for e in entries], [e.job_id for e in entries]))


class Credits(Area):
    async def settle(self, *, now: datetime, half_life_s: float, limit: int = 500) -> Settled:
        """Settles up to ``limit`` ended jobs, oldest first; their tenants' fair
        shares forget what they used with ``half_life_s``."""
        async with self.db.tx() as conn:
            ended = await fetch_all(conn, _ENDED, {"now": now, "limit": limit})
            if not ended:
                return Settled()
            settled = Settled(len(ended))
            for row in ended:
                tenant = row["tenant"]
                settled.gpu_seconds[tenant] = settled.gpu_seconds.get(tenant, 0.0) + row["gpu_seconds"]
                settled.credits[tenant] = settled.credits.get(tenant, 0.0) + row["charged"]
            # Tenants locked in name order, as admission locks them: no deadlock.
            tenants = sorted(settled.credits)
            await conn.execute("SELECT 1 FROM tenants WHERE name = ANY(%s) ORDER BY name FOR UPDATE", (tenants,))
            charges = {
                "now": now,
                "ids": [r["id"] for r in ended],
                "tenants": [r["tenant"] for r in ended],
                "charged": [r["charged"] for r in ended],
            }
            await conn.execute(_CHARGE, charges)
            # Settled: what each job held is released, never added to a balance.
            await conn.execute(
                """
                UPDATE jobs j SET settled_at = %s, credits_charged = s.charged
                FROM unnest(%s::varchar[], %s::float8[]) AS s(id, charged) WHERE j.id = s.id
                """,
                (now, charges["ids"], charges["charged"]),
            )
            await conn.execute(
                _USAGE,
                (
                    [r["tenant"] for r in ended],
                    [r["day"] for r in ended],
                    [r["gpu_seconds"] for r in ended],
                    [r["charged"] for r in ended],
                ),
            )
            used = {t: s for t, s in settled.gpu_seconds.items() if s > 0}
            if used:
                shares = {"now": now, "tenants": list(used), "used": list(used.values()), "half_life_s": half_life_s}
                await conn.execute(_SHARES, shares)
            return settled

    async def held(self, tenants: Sequence[str]) -> dict[str, float]:
        """What each of these tenants' open jobs hold of its credits (0: nothing)."""
        async with self.db.connection() as conn:
            found = await open_jobs(conn, tenants)
        return {tenant: found[tenant].held if tenant in found else 0.0 for tenant in tenants}

    async def entries(self, tenant: str, *, limit: int = 20) -> list[CreditEntry]:
        """The latest entries of the tenant's credit ledger, newest first."""
        rows = await self.db.all(
            """
            SELECT tenant, at, kind, amount, job_id FROM credit_entries
            WHERE tenant = %s ORDER BY at DESC, id DESC LIMIT %s
            """,
            (tenant, limit),
        )
        return [CreditEntry.of(row) for row in rows]

    async def shares(self) -> list[TenantShare]:
        """Every tenant's weight and the GPU-seconds it used, as last settled."""
        return [TenantShare.of(r) for r in await self.db.all(_READ_SHARES)]

    async def usage(self, tenant: str, day: date) -> DayUsage:
        """What the tenant's jobs settled on ``day`` (UTC) cost."""
        row = await self.db.one(
            "SELECT jobs, gpu_seconds, credits FROM tenant_usage WHERE tenant = %s AND day = %s", (tenant, day)
        )
        return DayUsage(row["jobs"], row["gpu_seconds"], row["credits"]) if row else DayUsage()
