"""Settling what ended jobs cost: each tenant is given back what its jobs reserved
and did not use (or charged what they used beyond), and its usage of the day
counted, and its GPU-seconds added to its fair share; once per job, by whichever
scheduler replica gets to it first."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime

from services.db.repository.database import Area, fetch_all
from services.db.tenant_records import TenantShare

_ENDED = """
SELECT id, tenant, credits_reserved, gpu_seconds, gpu_seconds * price AS charged,
       (coalesce(finished_at, %(now)s) AT TIME ZONE 'UTC')::date AS day
FROM jobs
WHERE settled_at IS NULL AND status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'EXPIRED')
ORDER BY finished_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
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


class Credits(Area):
    async def settle(self, *, now: datetime, half_life_s: float, limit: int = 500) -> Settled:
        """Settles up to ``limit`` ended jobs, oldest first; their tenants' fair
        shares forget what they used with ``half_life_s``."""
        async with self.db.tx() as conn:
            ended = await fetch_all(conn, _ENDED, {"now": now, "limit": limit})
            if not ended:
                return Settled()
            back: dict[str, float] = {}
            settled = Settled(len(ended))
            for row in ended:
                tenant = row["tenant"]
                back[tenant] = back.get(tenant, 0.0) + row["credits_reserved"] - row["charged"]
                settled.gpu_seconds[tenant] = settled.gpu_seconds.get(tenant, 0.0) + row["gpu_seconds"]
                settled.credits[tenant] = settled.credits.get(tenant, 0.0) + row["charged"]
            # Tenants locked in name order, as admission locks them: no deadlock.
            await conn.execute("SELECT 1 FROM tenants WHERE name = ANY(%s) ORDER BY name FOR UPDATE", (sorted(back),))
            await conn.execute(
                """
                UPDATE tenants t SET credits = t.credits + b.back
                FROM unnest(%s::varchar[], %s::float8[]) AS b(name, back)
                WHERE t.name = b.name AND t.credits IS NOT NULL
                """,
                (list(back), list(back.values())),
            )
            await conn.execute(
                """
                UPDATE jobs j SET settled_at = %s, credits_charged = s.charged
                FROM unnest(%s::varchar[], %s::float8[]) AS s(id, charged) WHERE j.id = s.id
                """,
                (now, [r["id"] for r in ended], [r["charged"] for r in ended]),
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

    async def shares(self) -> list[TenantShare]:
        """Every tenant's weight and the GPU-seconds it used, as last settled."""
        return [TenantShare.of(r) for r in await self.db.all(_READ_SHARES)]

    async def usage(self, tenant: str, day: date) -> DayUsage:
        """What the tenant's jobs settled on ``day`` (UTC) cost."""
        row = await self.db.one(
            "SELECT jobs, gpu_seconds, credits FROM tenant_usage WHERE tenant = %s AND day = %s", (tenant, day)
        )
        return DayUsage(row["jobs"], row["gpu_seconds"], row["credits"]) if row else DayUsage()
