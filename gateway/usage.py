"""What GetStats answers: a tenant's jobs, credits and today's usage; and, to an
admin, every worker as presence says with what the database counted of it, the
job totals and the lanes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime

from gateway.auth import Caller
from gateway.fleet_messages import lanes_message, totals_message, worker_stats
from services import quotas
from services.db.repository import Repository
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import WorkerRecord
from services.presence_view import PresenceView
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


async def fleet_stats(
    repo: Repository, presence: PresenceView, stale_s: float
) -> tuple[list[pb.WorkerStats], pb.GlobalStats, list[pb.LaneQueue]]:
    """Every worker not gone, the job totals and the lanes, for an admin."""
    # What each worker says of itself from presence; what it has done, from the database.
    seen = [w for kind in WorkerKind for w in presence.all(kind, stale_after_s=stale_s)]
    counted = [w for kind in WorkerKind for w in await repo.workers.all(kind, stale_after_s=stale_s)]
    held = await repo.scheduling.held_per_worker()
    running = await repo.scheduling.running_per_worker()
    totals = totals_message(await repo.jobs.totals())
    return (
        fleet_workers(seen, counted, held, running),
        totals,
        lanes_message(await repo.jobs.counts_by_lane(), datetime.now(UTC)),
    )


def fleet_workers(
    seen: Sequence[WorkerRecord],
    counted: Sequence[WorkerRecord],
    held: Mapping[str, int],
    running: Mapping[str, Sequence[str]],
) -> list[pb.WorkerStats]:
    """Every worker presence sees and that is not gone, with what the database
    counted of it, matched by kind and id: a decoder's heartbeat under a sampler's
    id shows none of the sampler's jobs (only samplers hold jobs)."""
    done = {(w.kind, w.id): w for w in counted}
    stats = []
    for worker in seen:
        worker = with_counts(worker, done.get((worker.kind, worker.id)))
        if worker.status == WorkerStatus.GONE:
            continue
        sampler = worker.kind == WorkerKind.SAMPLER
        stats.append(
            worker_stats(
                worker, held.get(worker.id, 0) if sampler else 0, running.get(worker.id, ()) if sampler else ()
            )
        )
    return stats


def with_counts(worker: WorkerRecord, counted: WorkerRecord | None) -> WorkerRecord:
    """A worker as presence says, with the jobs it completed and failed and its busy
    time as the database counted them."""
    if counted is None:
        return worker
    return replace(worker, completed=counted.completed, errors=counted.errors, busy_seconds=counted.busy_seconds)
