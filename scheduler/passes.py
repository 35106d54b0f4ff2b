"""The scheduler's passes, each the same three moves: read a fleet snapshot from the
database (``scheduler.facts``), decide with the driver (``scheduler.driver``),
write what was decided. Replicas take turns through the repository's locks: a
pass another replica holds returns None."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from scheduler import driver, facts, reports, spans
from scheduler.costs import costs_from
from scheduler.estimates import Durations
from scheduler.learning import durations_from, fold_run_times
from scheduler.policy import ModelCost, Placement
from scheduler.recovery import Recovery, RecoveryConfig
from scheduler.snapshot import TenantUsage, Worker
from scheduler.stalled import recover_stalled
from scheduler.suspend_requests import Preempter
from scheduler.views import JobViews
from services.bus.dispatch import Bus, Dispatch
from services.bus.events import Events, JobEvent
from services.bus.presence_board import PresenceBoard
from services.config.placement import check_names
from services.config.sections import SchedulerSettings
from services.db.records import Assignment, JobSummary
from services.db.repository import Repository
from services.db.states import JobStatus, WorkerKind
from services.db.worker_records import WarmPlan, WorkerRecord
from services.errors import BusError
from services.generation import Prompts
from services.mesh.rpc import MeshIdentity
from services.models.registry import ModelRegistry
from services.presence_view import PresenceView
from services.telemetry import logs

log = logging.getLogger(__name__)

# Run times folded into the learned estimates in one pass.
LEARN_BATCH = 500


class Passes:
    def __init__(
        self,
        settings: SchedulerSettings,
        repo: Repository,
        bus: Bus,
        registry: ModelRegistry,
        *,
        stale_after_s: float,
        presence: PresenceView,
        board: Callable[[], Awaitable[PresenceBoard]],
        mesh: MeshIdentity | None = None,
    ) -> None:
        check_names(settings.placement, settings.preemption, {m.capability for m in registry.models.values()})
        self.settings = settings
        self.placement = settings.placement
        self.stale_after_s = stale_after_s
        self.repo = repo
        self.bus = bus
        self.presence = presence  # the samplers and decoders, as their heartbeats say
        self.board = board  # where warm plans are stored
        self.events = Events(bus.nc, publisher="scheduler")
        self.preempter = Preempter(repo, settings.placement, settings.preemption, mesh)
        self.recovery = RecoveryConfig(
            max_attempts=settings.max_attempts, timeouts={n: m.timeout_s for n, m in registry.models.items()}
        )
        self.costs = costs_from(registry)
        self.job_views = JobViews(self.placement, self.costs)
        self.durations = Durations()
        self.tenants: tuple[TenantUsage, ...] = ()  # their fair shares, as last read
        self._durations_read = float("-inf")
        self._waiting: dict[str, str] = {}  # job -> the capability it was last recorded waiting for
        self._facts: dict[str, tuple[WorkerRecord, Worker]] = {}  # by worker id: its record, made into facts

    async def learned_durations(self) -> Durations:
        """The learned durations (and the tenants' fair shares), reread at most
        every ``estimates_refresh_s``."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._durations_read >= self.placement.estimates_refresh_s:
            self.durations = durations_from(*await self.repo.estimates.learned())
            if self.placement.fair_share:
                self.tenants = tuple(map(facts.tenant, await self.repo.credits.shares()))
            self._durations_read = loop.time()
        return self.durations

    async def place(self) -> int:
        """Places what it can of the queue; returns how many jobs it placed."""
        durations = await self.learned_durations()
        now = datetime.now(UTC)
        workers = self.live_samplers()
        async with self.repo.scheduling.placement_pass(
            limit=self.settings.batch,
            max_attempts=self.settings.max_attempts,
            now=now,
            models=facts.window_models(workers, self.costs),
        ) as read:
            if read is None or not read.queued:
                return 0
            fleet = replace(
                facts.fleet_snapshot(now, queued=read.queued, held=read.held, tenants=self.tenants), workers=workers
            )
            decision = driver.place(
                fleet,
                self.costs,
                durations,
                self.placement,
                job_views=self.job_views,
                preemption=self.settings.preemption,
            )
            assignments = [
                Assignment(p.job_id, p.worker_id, reports.routing_json(p))
                for p in decision.placed
                if p.worker_id is not None
            ]
            scheduled = await read.assign(assignments)
        if scheduled:
            log.debug("placed %d jobs", len(scheduled))
            # Before the dispatches: a worker's RUNNING must not overtake its SCHEDULED.
            # Naming each one's worker: its streams trust that worker's events at once.
            await self.events.job(
                *(JobEvent(j.id, j.attempt, JobStatus.SCHEDULED, worker=j.worker_id or "") for j in scheduled)
            )
            # Published after the commit: a job left unpublished (this process dies
            # here, NATS is away) stays SCHEDULED and redispatch() publishes it again
            # under the same message id.
            await self.publish(scheduled, read.prompts)
            reports.count_placed(decision.placed, scheduled)
            spans.placed(scheduled, {a.job_id: a.routing for a in assignments})
        # After the dispatches, which wait on neither: urgent work left waiting
        # behind preemptible work makes room (its placement comes in a later pass,
        # once the GPU is free), and what no live sampler serves is noted.
        await self.preempter.after_pass(fleet, decision)
        await self.note_waiting(decision.placements)
        return len(scheduled)

    def live_samplers(self) -> tuple[Worker, ...]:
        """The live samplers as the policy's facts, from presence. A worker's facts
        are made again only when a heartbeat changed its record: a pass over a
        thousand GPUs rebuilds the few that spoke since the last."""
        records = self.presence.live(WorkerKind.SAMPLER, stale_after_s=self.stale_after_s)
        made = {}
        for record in records:
            known = self._facts.get(record.id)
            made[record.id] = known if known is not None and known[0] is record else (record, facts.worker(record))
        self._facts = made
        return tuple(worker for _, worker in made.values())

    async def note_waiting(self, placements: Sequence[Placement]) -> None:
        """Records on each job that no live sampler can serve what it waits for
        (once: a pass sees the same jobs again)."""
        waiting = {p.job_id: p.waiting_for for p in placements if p.waiting_for}
        new = {job: capability for job, capability in waiting.items() if self._waiting.get(job) != capability}
        if not new:
            return
        await self.repo.scheduling.note_waiting(new)
        if len(self._waiting) > 100_000:
            self._waiting.clear()  # bounded: a job seen again is recorded again, harmlessly
        self._waiting.update(new)

    async def publish(self, jobs: Sequence[JobSummary], prompts: Mapping[str, Prompts] | None = None) -> None:
        """Publishes the jobs of one pass together, each telling its worker how many
        of them it gets (so that it waits for those to form a batch, and no more),
        and, where known, its prompts (encoded while the worker writes its start)."""
        prompts = prompts or {}
        per_worker = collections.Counter(job.worker_id for job in jobs)
        pass_id = uuid.uuid4().hex[:12]
        published_at = time.time()
        dispatches = [
            (
                job.worker_id,
                Dispatch(
                    job.id,
                    job.attempt,
                    published_at,
                    pass_id,
                    per_worker[job.worker_id],
                    job.shape,
                    prompts.get(job.id),
                ),
            )
            for job in jobs
            if job.worker_id is not None
        ]
        try:
            await self.bus.publish_dispatches(dispatches)
        except BusError as exc:
            log.warning("%d dispatches not published, will retry: %s", len(dispatches), exc)

    async def redispatch(self) -> int:
        older = datetime.now(UTC) - timedelta(seconds=self.settings.redispatch_after_s)
        jobs = await self.repo.scheduling.scheduled_not_started(older_than=older)
        await self.publish(jobs)
        return len(jobs)

    async def recover(self, *, judge_heartbeats: bool) -> list[Recovery] | None:
        """Requeues what dead workers held, expires, fails and times out; see
        ``scheduler.recovery``. ``judge_heartbeats`` False: right after the
        database was away, when every heartbeat looks stale."""
        judging = judge_heartbeats and self.presence.settled_for(self.stale_after_s)
        # Samplers alone hold jobs; a decoder's heartbeat, whatever its id, keeps none alive.
        heard = self.presence.ages(WorkerKind.SAMPLER) if judging else None
        done = await recover_stalled(self.repo, self.recovery, stale_after_s=self.stale_after_s, heard=heard)
        if done is None:
            return None
        for action in done:
            log.warning("recovered %s", reports.describe(action), extra=logs.job_fields(action.job_id, action.attempt))
            reports.count_recovered(action)
        if done:
            # Requeued, failed or expired: streams read the outcome from the database.
            await self.events.job(*(JobEvent(a.job_id, a.attempt) for a in done))
            await self.events.work()
        return done

    async def learn(self) -> int | None:
        """Folds the run times workers recorded into the learned estimates."""
        gpus = {w.id: w.gpus for w in self.live_samplers() if w.gpus > 1}
        learned = await learn_run_times(self.repo, self.costs, limit=LEARN_BATCH, gpus=gpus)
        if learned:
            self._durations_read = float("-inf")  # reread at the next pass
        return learned

    async def plan(self) -> dict[str, WarmPlan] | None:
        """Each live sampler's warm set, from the demand of the last window."""
        durations = await self.learned_durations()
        now = datetime.now(UTC)
        window = self.settings.demand_window_s
        async with self.repo.scheduling.planning_pass(
            since=now - timedelta(seconds=window), newer_since=now - timedelta(seconds=window / 2)
        ) as read:
            if read is None:
                return None
            workers = self.presence.live(WorkerKind.SAMPLER, stale_after_s=self.stale_after_s)
            fleet = facts.fleet_snapshot(now, workers=workers, submitted_counts=read.demand)
            warm = driver.plan_warm(fleet, self.costs, durations, self.placement, window_s=window) or {}
            plans = {wid: WarmPlan(p.primary, tuple(sorted(p.models))) for wid, p in warm.items()}
            # Stored while the planner lock is held; only what changed, each once.
            board = await self.board()
            for worker_id, plan in sorted(plans.items()):
                if self.presence.plan(worker_id) != plan:
                    await board.store_plan(worker_id, plan)
        if plans:
            log.debug("warm sets: %s", {w: p.models for w, p in plans.items()})
        return plans

    async def forget_gone_workers(self) -> list[str]:
        """Workers silent for ``worker_forget_after_s`` are gone for good: their
        consumer, what is left on their subject, and their row go."""
        gone_for = self.settings.worker_forget_after_s
        if not self.presence.settled_for(0.0):
            return []  # who was heard from lately is unknown while NATS is away
        forgotten = []
        for kind in WorkerKind:
            heard_from = self.presence.fresh(kind, stale_after_s=gone_for)
            for worker_id in await self.repo.workers.forgettable(kind, gone_for_s=gone_for, heard_from=heard_from):
                await self.bus.forget_worker(worker_id)
                if await self.repo.workers.forget(worker_id, gone_for_s=gone_for):
                    forgotten.append(worker_id)
        if forgotten:
            log.info("forgot workers gone for good: %s", ", ".join(forgotten))
        return forgotten


async def learn_run_times(
    repo: Repository, costs: Mapping[str, ModelCost], *, limit: int, gpus: Mapping[str, int] | None = None
) -> int | None:
    """One learning pass: folds up to ``limit`` recorded run times into the stored
    estimates; returns how many, or None if another replica is learning. ``gpus``:
    each live group's devices (its spanning runs are learned apart)."""
    async with repo.estimates.learn_pass(limit=limit) as learning:
        if learning is None:
            return None
        if not learning.facts:
            return 0
        shapes, speeds = fold_run_times(costs, learning.shapes, learning.speeds, learning.facts, gpus or {})
        await learning.store(shapes, speeds, now=datetime.now(UTC))
        return len(learning.facts)
