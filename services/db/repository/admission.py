"""Submits by tenants with limits: in one transaction that locks each tenant's row,
so that every gateway replica decides on the same figures in turn and 50
concurrent submits against room (or credits) for 10 let exactly 10 in. A job let
in holds its ``credits_reserved`` of its tenant's credits from there until it is
settled (nothing, for a tenant without a credit limit); the day's first submit
gives the tenant its daily credits, an entry of its ledger. A moderation draws on
its tenant's rate bucket the same way, and on nothing else; and a look at the
limits, without a lock, comes before a submit's costly work."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from services import quotas
from services.db.records import JobRecord, NewJob
from services.db.repository.credits import open_jobs, record
from services.db.repository.database import Area, Row, fetch_all
from services.db.repository.job_inserts import IdempotencyKey, find_earlier, insert, stored
from services.db.tenant_records import TOP_UP, CreditEntry, OpenJobs

_READ_TENANTS = """
SELECT name, max_jobs, rate_per_s, rate_tokens, rate_at, credits, daily_credits, credits_day FROM tenants
WHERE name = ANY(%s) ORDER BY name
"""
_LOCK_TENANTS = _READ_TENANTS + "FOR UPDATE\n"
_DRAW = "UPDATE tenants SET rate_tokens = %s, rate_at = %s WHERE name = %s"
_WRITE_BACK = """
UPDATE tenants SET rate_tokens = %s, rate_at = %s, credits = credits + %s, credits_day = %s WHERE name = %s
"""


class Admission(Area):
    async def create_within_limits(
        self, submits: Sequence[tuple[NewJob, datetime]]
    ) -> list[tuple[JobRecord, bool] | quotas.Refusal]:
        """Per submit, in order: the stored job and whether an earlier submit with its
        idempotency key made it (a repeat is never refused), or why its tenant's
        limits keep it out (then nothing is stored)."""
        jobs = [job for job, _ in submits]
        now = max(at for _, at in submits)
        names = sorted({job.tenant for job in jobs})
        async with self.db.tx() as conn:
            # Locked in name order: two batches of the same tenants never deadlock.
            tenants = await fetch_all(conn, _LOCK_TENANTS, (names,))
            open_ = await open_jobs(conn, names)
            earlier = await find_earlier(conn, jobs)
            # Each idempotency key counts once: the first submit of a key not used
            # before is new, the others repeat it.
            new: list[tuple[NewJob, datetime]] = []
            first: dict[IdempotencyKey, NewJob] = {}
            for job, at in submits:
                key = (job.tenant, job.idempotency_key)
                if job.idempotency_key and (key in earlier or key in first):
                    continue
                if job.idempotency_key:
                    first[key] = job
                new.append((job, at))
            loads = _loads(tenants, open_)
            decisions, after = quotas.admit(loads, [(job.tenant, job.credits_reserved) for job, _ in new], now)
            refused = {job.id: refusal for (job, _), refusal in zip(new, decisions, strict=True) if refusal}
            # Each job holds what admit held for it: nothing, for a tenant without a limit.
            let_in = [
                (replace(job, credits_reserved=quotas.reservation(loads.get(job.tenant), job.credits_reserved)), at)
                for job, at in new
                if job.id not in refused
            ]
            inserted = await insert(conn, let_in)
            # A repeat within the batch finds the job the first of its key made.
            earlier |= await find_earlier(conn, [job for job in jobs if job.id not in inserted])
            for load in after.values():
                if load != loads[load.name]:
                    written = (load.tokens, load.tokens_at, load.topped_up, load.credits_day, load.name)
                    await conn.execute(_WRITE_BACK, written)
            await record(conn, [CreditEntry(a.name, now, TOP_UP, a.topped_up) for a in after.values() if a.topped_up])
        # A repeat of a refused submit is refused with it.
        for job in jobs:
            maker = first.get((job.tenant, job.idempotency_key))
            if job.id not in inserted and maker is not None and maker.id in refused and job.idempotency_key:
                refused[job.id] = refused[maker.id]
        return [refused[job.id] if job.id in refused else stored(job, inserted, earlier) for job in jobs]

    async def refusal(self, tenant: str, cost: float, now: datetime) -> quotas.Refusal | None:
        """Why ``tenant``'s limits would keep out a job costing ``cost`` credits now,
        read without a lock and changing nothing: a look before costly work (an input
        image's decoding, with a cost of 0 while its estimate is unknown; a prompt's
        expansion), which ``create_within_limits`` decides for good."""
        async with self.db.connection() as conn:
            tenants = await fetch_all(conn, _READ_TENANTS, ([tenant],))
            loads = _loads(tenants, await open_jobs(conn, [tenant]))
        [decision], _ = quotas.admit(loads, [(tenant, cost)], now)
        return decision

    async def draw(self, tenant: str, now: datetime) -> quotas.Refusal | None:
        """One call of ``tenant``'s that is no submit (a moderation) drawn from its
        rate bucket, under its row's lock as a submit's; or why not (then nothing
        is drawn)."""
        async with self.db.tx() as conn:
            tenants = await fetch_all(conn, _LOCK_TENANTS, ([tenant],))
            if not tenants:
                return None
            load = _loads(tenants, {})[tenant]  # its jobs unread: only the bucket counts
            drawn = quotas.draw(load, now)
            if isinstance(drawn, quotas.Refusal):
                return drawn
            if drawn != load:
                await conn.execute(_DRAW, (drawn.tokens, drawn.tokens_at, tenant))
        return None


def _loads(tenants: Sequence[Row], open_: dict[str, OpenJobs]) -> dict[str, quotas.TenantLoad]:
    """Each tenant's load, from its row and its open jobs."""
    return {
        r["name"]: quotas.TenantLoad(
            r["name"],
            r["max_jobs"],
            open_.get(r["name"], OpenJobs()).active,
            r["rate_per_s"],
            r["rate_tokens"],
            r["rate_at"],
            r["credits"],
            r["daily_credits"],
            r["credits_day"],
            held=open_.get(r["name"], OpenJobs()).held,
        )
        for r in tenants
    }
