"""What a tenant reads of itself in GetStats: its jobs, credits and today's usage."""

from __future__ import annotations

from datetime import datetime

from gateway.auth import Caller
from services import quotas
from services.db.repository import Repository
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb


async def tenant_usage(repo: Repository, caller: Caller, now: datetime) -> pb.TenantUsage:
    active = await repo.jobs.active(caller.tenant)
    today = await repo.credits.usage(caller.tenant, now.date())
    usage = pb.TenantUsage(
        tenant=caller.tenant,
        queued=active.queued,
        running=active.running,
        gpu_seconds_today=today.gpu_seconds,
        credits_today=today.credits,
    )
    # Read fresh: the caller's terms are cached, and credits move with every job.
    tenant = await repo.tenants.find(caller.tenant) if caller.terms is not None else None
    if tenant is not None:
        terms = tenant.terms
        # What it may still reserve, as its next submit sees it: today's daily
        # credits given, less what its open jobs hold.
        balance, _ = quotas.refilled(terms.credits, terms.daily_credits, tenant.credits_day, now.date())
        usage.lane = terms.lane
        if balance is not None:
            held = (await repo.credits.held([tenant.name]))[tenant.name]
            usage.credits = balance - held
        if terms.daily_credits is not None:
            usage.daily_credits = terms.daily_credits
    return usage
