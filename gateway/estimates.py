"""When a submitted job would start and finish: the scheduler's pure estimate over
the fleet's held work and the work queued ahead, read at most every
``estimates_refresh_s`` (the fleet) or shared by concurrent submits (the queue)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from datetime import datetime

from scheduler import admission, facts, policy
from scheduler.learning import durations_from
from scheduler.views import worker_views
from services.coalesce import SingleFlight
from services.config.placement import PlacementSettings
from services.db.counts import ShapeCount
from services.db.records import NewJob
from services.db.repository import Repository
from services.db.states import WorkerKind
from services.presence_view import PresenceView


class Estimator:
    def __init__(
        self,
        repo: Repository,
        presence: PresenceView,
        costs: Mapping[str, policy.ModelCost],
        config: PlacementSettings,
        *,
        stale_after_s: float,
    ) -> None:
        self.repo = repo
        self.presence = presence
        self.costs = costs
        self.config = config
        self.stale_after_s = stale_after_s
        self._fleet_view: tuple[policy.Fleet, list[policy.WorkerView]] | None = None
        self._fleet_read = 0.0
        self._queued_ahead: dict[int, SingleFlight[list[ShapeCount]]] = {}

    async def fleet(self, now: datetime) -> tuple[policy.Fleet, list[policy.WorkerView]]:
        """The scheduler's view of the fleet, reread at most every estimates_refresh_s."""
        loop = asyncio.get_running_loop()
        if self._fleet_view is None or loop.time() - self._fleet_read >= self.config.estimates_refresh_s:
            durations = durations_from(*await self.repo.estimates.learned())
            fleet = policy.Fleet(self.costs, durations, adapter_load_s=self.config.adapter_load_s)
            workers = self.presence.live(WorkerKind.SAMPLER, stale_after_s=self.stale_after_s)
            held = await self.repo.scheduling.held_groups()
            self._fleet_view = (fleet, worker_views(facts.fleet_snapshot(now, workers=workers, held=held), fleet))
            self._fleet_read = loop.time()
        return self._fleet_view

    async def estimate(self, job: policy.JobView, now: datetime) -> admission.Estimate | None:
        """When the job would start and how long it would run, from the work held
        by the workers and the work queued ahead of it (read fresh, or by a read
        that was under way when the submit arrived)."""
        fleet, workers = await self.fleet(now)
        read = self._queued_ahead.get(job.priority)
        if read is None:
            read = self._queued_ahead[job.priority] = SingleFlight(
                functools.partial(self.repo.jobs.queued_ahead_shapes, job.priority)
            )
        ahead = [
            (policy.JobView("", a.model, a.width, a.height, a.steps, a.num_images, frames=a.frames), a.count)
            for a in await read()
        ]
        return admission.estimate(job, ahead, workers, fleet)

    async def gpu_seconds(self, job: policy.JobView, now: datetime) -> float:
        """How long the job would sample on a GPU of speed 1, from what the fleet
        has learned of its shape: what reserving its credits goes by."""
        fleet, _ = await self.fleet(now)
        return policy.gpu_seconds(job, fleet)

    def job_view(self, new: NewJob) -> policy.JobView:
        """The policy's view of a job just submitted."""
        cost = self.costs.get(new.params.model)
        p = new.params
        return policy.JobView(
            new.id,
            p.model,
            p.width,
            p.height,
            p.steps,
            p.num_images,
            new.priority,
            target_s=self.config.target_s(new.lane, cost.capability if cost is not None else ""),
            frames=p.frames,
            adapters=frozenset(a.key for a in p.adapters),  # its estimate counts their loads where they are cold
        )
