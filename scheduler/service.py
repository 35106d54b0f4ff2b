"""The scheduler: a fast loop that places queued jobs with the pure policy and
publishes each to its worker's JetStream subject, a recovery loop that takes back
what dead workers held (and expires, times out and fails), and a slow loop that
plans which models each GPU keeps warm. Any number of replicas may run; Postgres
advisory locks let one at a time do each pass."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from scheduler import policy
from scheduler.estimates import Durations, Shape
from scheduler.job_gauges import job_gauges_loop
from scheduler.metrics import PLACEMENTS, QUEUE_WAIT
from scheduler.recovery import RecoveryConfig, review
from scheduler.suspend_requests import PassView, Preempter
from scheduler.views import (
    costs_from,
    durations_from,
    fold_run_times,
    gpu_views,
    job_view,
    measured_costs,
    worker_views,
)
from scheduler.warm_planner import Submitted, forecast, plan_warm_sets
from services.bus.dispatch import Bus, Dispatch
from services.bus.events import Events, JobEvent
from services.config.placement import PlacementSettings, check_names
from services.config.sections import KernelSettings, SchedulerSettings
from services.db.migrate import upgrade_when_reachable
from services.db.records import (
    Assignment,
    Fail,
    HeldGroup,
    JobSummary,
    Recovery,
    Requeue,
    SubmittedCount,
    WarmPlan,
    WorkerRecord,
)
from services.db.repository import Repository
from services.db.states import JobStatus
from services.errors import BusError, StoreError
from services.generation import JobShape
from services.models.registry import ModelRegistry
from services.ops.lifecycle import run_service
from services.rpc.server import Server, build_server
from services.telemetry import logs, tracing
from services.telemetry.metrics import ATTEMPTS_FAILED, JOBS_FINISHED, REQUEUES, serve_metrics

log = logging.getLogger(__name__)

# Run times folded into the learned estimates in one pass.
LEARN_BATCH = 500


def make_decide(fleet: policy.Fleet, config: PlacementSettings, *, now: datetime, made: PassView):
    """The pass's decision, what it saw and decided kept in ``made``."""

    def decide(
        queued: Sequence[JobSummary], workers: Sequence[WorkerRecord], held: Sequence[HeldGroup]
    ) -> list[Assignment]:
        measured = replace(fleet, costs=measured_costs(fleet.costs, workers))
        views = worker_views(workers, held, measured)
        jobs = [job_view(j, config, measured.costs) for j in queued]
        placements = policy.plan(jobs, views, measured, config, now=now.timestamp())
        made.placements.extend(placements)
        made.jobs.update((j.id, j) for j in queued)
        made.workers, made.fleet, made.config = views, measured, config
        return [Assignment(p.job_id, p.worker_id, routing_json(p)) for p in placements if p.worker_id is not None]

    return decide


def make_plan(fleet: policy.Fleet, config: PlacementSettings, *, window_s: float):
    def plan(workers: Sequence[WorkerRecord], demand: Sequence[SubmittedCount]) -> dict[str, WarmPlan]:
        submitted = [submitted_work(d, fleet, config) for d in demand if d.model in fleet.costs]
        if not submitted:
            return {}  # nothing to plan from: leave the warm sets as they are
        predicted = forecast(submitted, window_s)
        gpus = gpu_views(workers, fleet.durations)
        capacity = sum(g.speed for g in gpus if g.state == policy.READY)
        plans = plan_warm_sets(
            predicted.planning(config.latency_headroom, capacity),
            gpus,
            measured_costs(fleet.costs, workers),
            dict(config.capability_caps),
            best_effort=predicted.best_effort_models,
        )
        return {wid: WarmPlan(p.primary, tuple(sorted(p.models))) for wid, p in plans.items()}

    return plan


def submitted_work(d: SubmittedCount, fleet: policy.Fleet, config: PlacementSettings) -> Submitted:
    """Jobs submitted of one shape and lane as the forecast takes them: their
    speed-1.0 seconds, and their latency class."""
    cost = fleet.costs[d.model]
    seconds = d.count * fleet.durations.shape_seconds(
        Shape(d.model, d.width * d.height, d.steps, d.num_images), cost.step_s_512
    )
    bound = config.plans_as_latency_bound(config.target_s(d.lane, cost.capability))
    return Submitted(d.model, seconds, d.newer, bound, d.backlog)


def placement_kind(p: policy.Placement) -> str:
    """warm, cold or batch: what the chosen worker had to do to take the job."""
    chosen = next((c for c in p.candidates if c.worker_id == p.worker_id), None)
    note = chosen.note if chosen is not None else ""
    return "batch" if note.startswith("joins a batch") else "cold" if note.startswith("cold") else "warm"


def count_placed(placements: Sequence[policy.Placement], jobs: Sequence[JobSummary]) -> None:
    placed = {p.job_id: p for p in placements if p.worker_id is not None}
    for job in jobs:
        p = placed.get(job.id)
        if p is not None:
            PLACEMENTS.labels(kind=placement_kind(p)).inc()
        if job.attempt == 1 and job.scheduled_at is not None:
            QUEUE_WAIT.labels(lane=job.lane).observe((job.scheduled_at - job.created_at).total_seconds())


def count_recovered(action: Recovery) -> None:
    if isinstance(action, Requeue):
        REQUEUES.labels(cause=action.cause).inc()
        if action.failure is not None:
            ATTEMPTS_FAILED.labels(cause=action.cause).inc()
    elif isinstance(action, Fail):
        JOBS_FINISHED.labels(outcome="failed").inc()
        if action.failure is not None:
            ATTEMPTS_FAILED.labels(cause=action.cause).inc()
    else:
        JOBS_FINISHED.labels(outcome="expired").inc()


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
    def __init__(
        self, settings: SchedulerSettings, repo: Repository, bus: Bus, registry: ModelRegistry, *, stale_after_s: float
    ) -> None:
        self.settings = settings
        self.stale_after_s = stale_after_s
        self.repo = repo
        self.bus = bus
        self.events = Events(bus.nc)
        # Set when NATS says there may be work to place.
        self._wake = asyncio.Event()
        self.config = settings.placement
        check_names(settings.placement, settings.preemption, {m.capability for m in registry.models.values()})
        self.preempter = Preempter(repo, settings.preemption)
        self.recovery = RecoveryConfig(
            max_attempts=settings.max_attempts, timeouts={n: m.timeout_s for n, m in registry.models.items()}
        )
        self.costs = costs_from(registry)
        self.durations = Durations()
        self._durations_read = float("-inf")
        # Since when the database has answered this replica without a failure.
        # Heartbeats are judged only once that is longer than a heartbeat's
        # timeout: after an outage every heartbeat looks stale, and the workers
        # need one interval to show they are alive.
        self._db_up_since: float | None = None
        self._last_prune = float("-inf")

    def _db_answered(self, ok: bool) -> None:
        now = asyncio.get_running_loop().time()
        if not ok:
            self._db_up_since = None
        elif self._db_up_since is None:
            self._db_up_since = now

    def _may_judge_heartbeats(self) -> bool:
        up = self._db_up_since
        return up is not None and asyncio.get_running_loop().time() - up >= self.stale_after_s

    async def fleet(self) -> policy.Fleet:
        loop = asyncio.get_running_loop()
        if loop.time() - self._durations_read >= self.config.estimates_refresh_s:
            self.durations = durations_from(*await self.repo.estimates.learned())
            self._durations_read = loop.time()
        return policy.Fleet(self.costs, self.durations)

    async def run_pass(self) -> int:
        now = datetime.now(UTC)
        made = PassView([], {}, [])
        decide = make_decide(await self.fleet(), self.config, now=now, made=made)
        scheduled = await self.repo.scheduling.schedule_pass(
            decide,
            limit=self.settings.batch,
            stale_after_s=self.stale_after_s,
            max_attempts=self.settings.max_attempts,
            now=now,
        )
        placements = made.placements
        # Urgent work left waiting behind preemptible work makes room (its
        # placement comes in a later pass, once the GPU is free).
        await self.preempter.after_pass(made, now=now.timestamp())
        if not scheduled:
            return 0
        log.debug("placed %d jobs", len(scheduled))
        # Before the dispatches: a worker's RUNNING must not overtake its SCHEDULED.
        await self.events.job(*(JobEvent(j.id, j.attempt, JobStatus.SCHEDULED) for j in scheduled))
        # Published after the commit: a job left unpublished (this process dies
        # here, NATS is away) stays SCHEDULED and redispatch() publishes it again
        # under the same message id.
        await self._publish(scheduled)
        count_placed(placements, scheduled)
        tracing.placed(scheduled, {p.job_id: routing_json(p) for p in placements if p.worker_id is not None})
        return len(scheduled)

    async def _publish(self, jobs: Sequence[JobSummary]) -> None:
        """Publishes the jobs of one pass together, each telling its worker how many
        of them it gets (so that it waits for those to form a batch, and no more)."""
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
                    JobShape(job.model, job.width, job.height, job.steps, job.guidance_scale, job.num_images),
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
        await self._publish(jobs)
        return len(jobs)

    async def recovery_pass(self) -> list[Recovery] | None:
        """Requeues what dead workers held, expires, fails and times out; see
        ``scheduler.recovery``."""
        done = await self.repo.recovery.recovery_pass(
            lambda jobs, dead, now: review(jobs, dead, now, self.recovery),
            stale_after_s=self.stale_after_s,
            judge_heartbeats=self._may_judge_heartbeats(),
            max_attempts=self.settings.max_attempts,
            shortest_timeout_s=self.recovery.shortest_timeout_s,
        )
        for action in done or []:
            log.warning("recovered %s", describe(action), extra=logs.job_fields(action.job_id, action.attempt))
            count_recovered(action)
        if done:
            # Requeued, failed or expired: streams read the outcome from the database.
            await self.events.job(*(JobEvent(a.job_id, a.attempt) for a in done))
            await self.events.work()
        return done

    async def learn_pass(self) -> int | None:
        """Folds the run times workers recorded into the learned estimates."""
        learned = await self.repo.estimates.learn_pass(
            fold_run_times(self.costs), limit=LEARN_BATCH, now=datetime.now(UTC)
        )
        if learned:
            self._durations_read = float("-inf")  # reread at the next pass
        return learned

    async def forget_gone_workers(self) -> list[str]:
        """Workers silent for ``worker_forget_after_s`` are gone for good: their
        consumer, what is left on their subject, and their row go."""
        gone_for = self.settings.worker_forget_after_s
        forgotten = []
        for worker_id in await self.repo.workers.forgettable(gone_for_s=gone_for):
            await self.bus.forget_worker(worker_id)
            if await self.repo.workers.forget(worker_id, gone_for_s=gone_for):
                forgotten.append(worker_id)
        if forgotten:
            log.info("forgot workers gone for good: %s", ", ".join(forgotten))
        return forgotten

    async def placement_loop(self, stop: asyncio.Event) -> None:
        last_redispatch = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            placed = 0
            # Work arriving from here on wakes the next wait: nothing slips between.
            self._wake.clear()
            try:
                placed = await self.run_pass()
                self._db_answered(True)
                if loop.time() - last_redispatch > self.settings.redispatch_after_s / 2:
                    last_redispatch = loop.time()
                    await self.redispatch()
            except StoreError as exc:
                self._db_answered(False)
                log.warning("scheduling pass failed, will retry: %s", exc)
            if placed == 0:
                await self._idle(stop)

    async def _idle(self, stop: asyncio.Event) -> None:
        """Until there may be work to place (a job event on NATS says so), the
        scheduler interval passes, or the scheduler stops."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, timeout=self.settings.interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def recovery_loop(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        prune_every = min(60.0, self.settings.worker_forget_after_s / 2)
        while not stop.is_set():
            try:
                await self.recovery_pass()
                self._db_answered(True)
                await self.learn_pass()
                if loop.time() - self._last_prune >= prune_every:
                    self._last_prune = loop.time()
                    await self.forget_gone_workers()
                    await self.repo.checkpoints.prune()
            except StoreError as exc:
                self._db_answered(False)
                log.warning("recovery pass failed, will retry: %s", exc)
            except BusError as exc:
                log.warning("cannot forget a worker's consumer, will retry: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.recovery_interval_s)

    async def planning_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.plan_pass()
            except StoreError as exc:
                log.warning("planning pass failed, will retry: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.plan_interval_s)

    async def plan_pass(self) -> dict[str, WarmPlan] | None:
        now = datetime.now(UTC)
        window = self.settings.demand_window_s
        plans = await self.repo.scheduling.plan_pass(
            make_plan(await self.fleet(), self.config, window_s=window),
            since=now - timedelta(seconds=window),
            newer_since=now - timedelta(seconds=window / 2),
            stale_after_s=self.stale_after_s,
        )
        if plans:
            log.debug("warm sets: %s", {w: p.models for w, p in plans.items()})
        return plans

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.events.on_work(self._wake)
        except BusError as exc:
            log.warning("not woken by work events (placing every %.3fs): %s", self.settings.interval_s, exc)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.placement_loop(stop))
            tg.create_task(self.recovery_loop(stop))
            tg.create_task(self.planning_loop(stop))
            tg.create_task(job_gauges_loop(self.repo, [lane.name for lane in self.config.lanes], stop))
        await self.preempter.close()


def describe(action: Recovery) -> str:
    if isinstance(action, Requeue):
        why = action.failure.describe() if action.failure else "handed back, no attempt counted"
        return f"{action.job_id}: requeued ({why})"
    if isinstance(action, Fail):
        return f"{action.job_id}: FAILED ({action.reason})"
    return f"{action.job_id}: EXPIRED (deadline passed while queued)"


def create_server(settings: SchedulerSettings) -> Server:
    """Health checking only: the scheduler's work reaches it through Postgres."""
    return build_server([], settings.host, settings.port)


async def serve(kernel: KernelSettings, settings: SchedulerSettings, stop: asyncio.Event) -> None:
    serve_metrics(kernel, "scheduler")
    if not await upgrade_when_reachable(kernel.database_url, stop):
        return
    registry = ModelRegistry.load(kernel.model_registry or None)
    repo = Repository(kernel.database_url, pool_size=4, application_name=f"darkroom-scheduler-{os.getpid()}")
    server = create_server(settings)
    bus: Bus | None = None
    try:
        bus = await Bus.connect(
            kernel.nats_servers, name="darkroom-scheduler", replicas=kernel.nats_replicas, stop=stop
        )
        await server.grpc.start()
        await server.set_serving(True)
        log.info("scheduler running (health on port %d)", server.port)
        await Scheduler(settings, repo, bus, registry, stale_after_s=kernel.worker_stale_after_s).run(stop)
    finally:
        await server.grpc.stop(0)
        if bus is not None:
            await bus.close()
        await repo.close()


def main() -> None:
    run_service("scheduler", serve, SchedulerSettings)
