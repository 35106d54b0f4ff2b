"""The scheduler: a loop that places queued jobs with the pure policy and
publishes each to its worker's JetStream subject."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from scheduler import policy
from scheduler.views import costs_from, job_view, worker_views
from services.bus import Bus, Dispatch
from services.db.migrate import upgrade
from services.db.repository import Assignment, JobRecord, Repository, WorkerRecord
from services.errors import BusError, StoreError
from services.lifecycle import run_service
from services.models.registry import ModelRegistry
from services.settings import Settings

log = logging.getLogger("darkroom.scheduler")


def make_decide(costs: dict[str, policy.ModelCost], *, backlog_limit: int, now: datetime):
    def decide(
        queued: Sequence[JobRecord], workers: Sequence[WorkerRecord], held: Sequence[JobRecord]
    ) -> list[Assignment]:
        placements = policy.plan(
            [job_view(j) for j in queued],
            worker_views(workers, held, costs),
            costs,
            now=now,
            backlog_limit=backlog_limit,
        )
        return [Assignment(p.job_id, p.worker_id, routing_json(p)) for p in placements if p.worker_id is not None]

    return decide


def routing_json(p: policy.Placement) -> dict[str, object]:
    return {
        "worker_id": p.worker_id,
        "reason": p.reason,
        "candidates": [
            {
                "worker_id": c.worker_id,
                "eligible": c.eligible,
                "finish_s": c.finish_s if c.eligible else None,
                "note": c.note,
            }
            for c in p.candidates
        ],
    }


class Scheduler:
    def __init__(self, settings: Settings, repo: Repository, bus: Bus, registry: ModelRegistry) -> None:
        self.settings = settings
        self.repo = repo
        self.bus = bus
        self.costs = costs_from(registry)

    async def run_pass(self) -> int:
        now = datetime.now(UTC)
        decide = make_decide(self.costs, backlog_limit=self.settings.worker_backlog, now=now)
        scheduled = await self.repo.schedule_pass(
            decide, limit=self.settings.scheduler_batch, stale_after_s=self.settings.worker_stale_after_s, now=now
        )
        if scheduled:
            log.debug("placed %d jobs", len(scheduled))
        for job in scheduled or []:
            assert job.worker_id is not None
            # Published after the commit: if this process dies here the job stays
            # SCHEDULED and redispatch() publishes it again under the same id.
            await self.bus.publish_dispatch(job.worker_id, Dispatch(job.id, job.attempt))
        return len(scheduled or [])

    async def redispatch(self) -> int:
        older = datetime.now(UTC) - timedelta(seconds=self.settings.redispatch_after_s)
        jobs = await self.repo.scheduled_not_started(older_than=older)
        for job in jobs:
            assert job.worker_id is not None
            await self.bus.publish_dispatch(job.worker_id, Dispatch(job.id, job.attempt))
        return len(jobs)

    async def run(self, stop: asyncio.Event) -> None:
        last_redispatch = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            placed = 0
            try:
                placed = await self.run_pass()
                if loop.time() - last_redispatch > self.settings.redispatch_after_s / 2:
                    last_redispatch = loop.time()
                    await self.redispatch()
            except (StoreError, BusError) as exc:
                log.warning("scheduling pass failed, will retry: %s", exc)
            if placed == 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.scheduler_interval_s)


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    await asyncio.to_thread(upgrade, settings.database_url)
    registry = ModelRegistry.load(settings.model_registry or None)
    repo = Repository(settings.database_url, pool_size=4, application_name=f"darkroom-scheduler-{os.getpid()}")
    bus = await Bus.connect(settings.nats_url, name="darkroom-scheduler")
    try:
        log.info("scheduler running")
        await Scheduler(settings, repo, bus, registry).run(stop)
    finally:
        await bus.close()
        await repo.close()


def main() -> None:
    run_service("scheduler", serve)
