"""The scheduler: a fast loop that places queued jobs with the pure policy and
publishes each to its worker's JetStream subject, and a slow loop that plans
which models each GPU keeps warm. Any number of replicas may run; Postgres
advisory locks let one at a time do each pass."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from scheduler import policy
from scheduler.estimates import Durations, Shape
from scheduler.views import costs_from, durations_from, gpu_views, job_view, policy_config, worker_views
from scheduler.warmsets import demand_from, plan_warm_sets
from services.bus import Bus, Dispatch
from services.db.migrate import upgrade
from services.db.repository import Assignment, JobRecord, Repository, ShapeCount, WarmPlan, WorkerRecord
from services.errors import BusError, StoreError
from services.lifecycle import run_service
from services.models.registry import ModelRegistry
from services.settings import Settings

log = logging.getLogger("darkroom.scheduler")


def make_decide(fleet: policy.Fleet, config: policy.PolicyConfig, *, now: datetime):
    def decide(
        queued: Sequence[JobRecord], workers: Sequence[WorkerRecord], held: Sequence[JobRecord]
    ) -> list[Assignment]:
        placements = policy.plan(
            [job_view(j) for j in queued], worker_views(workers, held, fleet), fleet, config, now=now.timestamp()
        )
        return [Assignment(p.job_id, p.worker_id, routing_json(p)) for p in placements if p.worker_id is not None]

    return decide


def make_plan(fleet: policy.Fleet, config: policy.PolicyConfig, *, window_s: float):
    def plan(workers: Sequence[WorkerRecord], demand: Sequence[ShapeCount]) -> dict[str, WarmPlan]:
        recent = [
            (
                d.model,
                d.count
                * fleet.durations.shape_seconds(
                    Shape(d.model, d.width * d.height, d.steps, d.num_images), fleet.costs[d.model].step_s_512
                ),
            )
            for d in demand
            if d.model in fleet.costs
        ]
        if not recent:
            return {}  # nothing to plan from: leave the warm sets as they are
        plans = plan_warm_sets(
            demand_from(recent, window_s),
            gpu_views(workers, fleet.durations),
            fleet.costs,
            dict(config.capability_caps),
        )
        return {wid: WarmPlan(p.primary, tuple(sorted(p.models))) for wid, p in plans.items()}

    return plan


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
        self.config = policy_config(settings)
        self.costs = costs_from(registry)
        self.durations = Durations()
        self._durations_read = float("-inf")

    async def fleet(self) -> policy.Fleet:
        loop = asyncio.get_running_loop()
        if loop.time() - self._durations_read >= self.settings.estimates_refresh_s:
            self.durations = durations_from(*await self.repo.learned_estimates())
            self._durations_read = loop.time()
        return policy.Fleet(self.costs, self.durations)

    async def run_pass(self) -> int:
        now = datetime.now(UTC)
        decide = make_decide(await self.fleet(), self.config, now=now)
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

    async def plan_pass(self) -> dict[str, WarmPlan] | None:
        now = datetime.now(UTC)
        window = self.settings.demand_window_s
        plans = await self.repo.plan_pass(
            make_plan(await self.fleet(), self.config, window_s=window),
            since=now - timedelta(seconds=window),
            stale_after_s=self.settings.worker_stale_after_s,
            now=now,
        )
        if plans:
            log.debug("warm sets: %s", {w: p.models for w, p in plans.items()})
        return plans

    async def redispatch(self) -> int:
        older = datetime.now(UTC) - timedelta(seconds=self.settings.redispatch_after_s)
        jobs = await self.repo.scheduled_not_started(older_than=older)
        for job in jobs:
            assert job.worker_id is not None
            await self.bus.publish_dispatch(job.worker_id, Dispatch(job.id, job.attempt))
        return len(jobs)

    async def placement_loop(self, stop: asyncio.Event) -> None:
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

    async def planning_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.plan_pass()
            except StoreError as exc:
                log.warning("planning pass failed, will retry: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.plan_interval_s)

    async def run(self, stop: asyncio.Event) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.placement_loop(stop))
            tg.create_task(self.planning_loop(stop))


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
