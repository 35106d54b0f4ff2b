"""The scheduler: a loop that places queued jobs with the pure policy and
publishes each to its worker's JetStream subject."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from scheduler import policy
from services.bus import Bus, Dispatch
from services.db.migrate import upgrade
from services.db.repository import Assignment, JobRecord, Repository, WorkerRecord
from services.errors import BusError, StoreError
from services.lifecycle import run_service
from services.models.registry import ModelRegistry
from services.settings import Settings

log = logging.getLogger("darkroom.scheduler")


def costs_from(registry: ModelRegistry) -> dict[str, policy.ModelCost]:
    return {
        name: policy.ModelCost(step_s_512=spec.step_ms_512 / 1000.0, load_s=spec.load_s, vram_bytes=spec.vram_bytes)
        for name, spec in registry.models.items()
    }


def job_view(job: JobRecord) -> policy.JobView:
    return policy.JobView(job.id, job.model, job.width, job.height, job.steps, job.num_images)


def worker_views(
    workers: Sequence[WorkerRecord], held: Sequence[JobRecord], costs: dict[str, policy.ModelCost]
) -> list[policy.WorkerView]:
    views = []
    for w in workers:
        mine = [j for j in held if j.worker_id == w.id]
        work = 0.0
        for j in mine:
            cost = costs.get(j.model)
            if cost is None:
                continue
            done = j.progress_step / j.progress_total if j.progress_total else 0.0
            work += policy.run_seconds(job_view(j), cost, w.speed) * (1.0 - done)
        views.append(
            policy.WorkerView(
                id=w.id,
                models=frozenset(w.models),
                warm_models=frozenset(w.warm_models),
                vram_total_bytes=w.vram_total_bytes,
                vram_used_bytes=w.vram_used_bytes,
                speed=w.speed,
                held_jobs=len(mine),
                held_work_s=work,
            )
        )
    return views


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
    repo = Repository(settings.database_url, pool_size=4)
    bus = await Bus.connect(settings.nats_url, name="darkroom-scheduler")
    try:
        log.info("scheduler running")
        await Scheduler(settings, repo, bus, registry).run(stop)
    finally:
        await bus.close()
        await repo.close()


def main() -> None:
    run_service("scheduler", serve)
