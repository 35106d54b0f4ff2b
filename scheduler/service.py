"""The scheduler: a fast loop that places queued jobs and publishes each to its
worker's JetStream subject, a recovery loop that takes back what dead workers held
(and expires, times out and fails), and a slow loop that plans which models each
GPU keeps warm; each runs its pass (``scheduler.passes``) and survives the failure
of what it calls. Any number of replicas may run; PostgreSQL advisory locks let
one at a time do each pass."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from datetime import UTC, datetime

from scheduler.idle import next_idle_wait
from scheduler.job_gauges import job_gauges_loop
from scheduler.metrics import count_settled
from scheduler.passes import Passes
from services.bus.credentials import NatsCredentials
from services.bus.dispatch import Bus
from services.bus.presence_board import BoardOnConnection
from services.config.sections import KernelSettings, SchedulerSettings
from services.db.repository import Repository
from services.db.states import WorkerKind
from services.errors import BusError, StoreError
from services.mesh.rpc import MeshIdentity
from services.models.registry import ModelRegistry
from services.ops.host import Closing, GrpcServer, JetStream, Metrics, Migrations, Part, host
from services.ops.lifecycle import run_service
from services.presence_view import PresenceView, follow
from services.rpc.server import Server, build_server

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        settings: SchedulerSettings,
        repo: Repository,
        bus: Bus,
        registry: ModelRegistry,
        *,
        stale_after_s: float,
        heartbeat_interval_s: float = 1.0,
        mesh: MeshIdentity | None = None,
    ) -> None:
        self.settings = settings
        self.stale_after_s = stale_after_s
        self.repo = repo
        self.bus = bus
        # This replica beats in the presence bucket as often as workers do, and its
        # view expects to hear something at least every few beats: a watch that stops
        # delivering (its NATS server cut off, unnoticed yet) must not age the fleet.
        self.beat_every_s = heartbeat_interval_s
        self.replica = uuid.uuid4().hex[:12]
        self.presence = PresenceView(
            (WorkerKind.SAMPLER, WorkerKind.DECODER),
            expect_within_s=min(stale_after_s / 2, 3 * heartbeat_interval_s),
        )
        self.board = BoardOnConnection(lambda: bus.nc, replicas=bus.replicas, create=True)
        self.passes = Passes(
            settings,
            repo,
            bus,
            registry,
            stale_after_s=stale_after_s,
            presence=self.presence,
            board=self.board,
            mesh=mesh,
        )
        # Set when NATS says there may be work to place; whether it can (subscribed).
        self._wake = asyncio.Event()
        self._hears_work = False
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

    async def placement_loop(self, stop: asyncio.Event) -> None:
        last_redispatch = 0.0
        loop = asyncio.get_running_loop()
        floor_s, ceiling_s = self.settings.interval_s, self.settings.idle_interval_max_s
        wait_s = floor_s
        while not stop.is_set():
            placed = 0
            # Work arriving from here on wakes the next wait: nothing slips between.
            self._wake.clear()
            try:
                placed = await self.passes.place()
                self._db_answered(True)
                if loop.time() - last_redispatch > self.settings.redispatch_after_s / 2:
                    last_redispatch = loop.time()
                    await self.passes.redispatch()
            except StoreError as exc:
                self._db_answered(False)
                log.warning("scheduling pass failed, will retry: %s", exc)
            if placed:
                wait_s = floor_s
                continue
            woken = await self._idle(stop, wait_s)
            wait_s = next_idle_wait(wait_s, woken=woken, events=self._hears_work, floor_s=floor_s, ceiling_s=ceiling_s)

    async def _idle(self, stop: asyncio.Event, wait_s: float) -> bool:
        """Until there may be work to place (a work event on NATS says so), ``wait_s``
        passes, or the scheduler stops; whether an event ended it."""
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._wake.is_set()

    async def recovery_loop(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        prune_every = min(60.0, self.settings.worker_forget_after_s / 2)
        while not stop.is_set():
            try:
                await self.passes.recover(judge_heartbeats=self._may_judge_heartbeats())
                self._db_answered(True)
                await self.passes.learn()
                half_life = self.settings.placement.fair_share_half_life_s
                count_settled(await self.repo.credits.settle(now=datetime.now(UTC), half_life_s=half_life, limit=2000))
                if loop.time() - self._last_prune >= prune_every:
                    self._last_prune = loop.time()
                    await self.passes.forget_gone_workers()
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
                await self.passes.plan()
            except StoreError as exc:
                log.warning("planning pass failed, will retry: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.plan_interval_s)

    async def canary_loop(self, stop: asyncio.Event) -> None:
        """Beats in the presence bucket, for this replica's own view to hear."""
        while not stop.is_set():
            try:
                await (await self.board()).canary(self.replica)
            except BusError as exc:
                log.debug("no beat in the presence bucket: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.beat_every_s)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.passes.events.on_work(self._wake)
            self._hears_work = True
        except BusError as exc:
            log.warning("not woken by work events (placing every %.3fs): %s", self.settings.interval_s, exc)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow(self.presence, self.bus.nc, self.board, stop))
            tg.create_task(self.canary_loop(stop))
            tg.create_task(self.placement_loop(stop))
            tg.create_task(self.recovery_loop(stop))
            tg.create_task(self.planning_loop(stop))
            tg.create_task(job_gauges_loop(self.repo, [lane.name for lane in self.settings.placement.lanes], stop))
        await self.passes.preempter.close()


def create_server(settings: SchedulerSettings, mesh: MeshIdentity | None = None) -> Server:
    """Health checking only: the scheduler's work reaches it through Postgres."""
    return build_server([], settings.host, settings.port, mesh=mesh)


async def serve(kernel: KernelSettings, settings: SchedulerSettings, stop: asyncio.Event) -> int:
    registry = kernel.registry()
    repo = Repository(
        kernel.database_url,
        pool_size=4,
        application_name=f"darkroom-scheduler-{os.getpid()}",
        pooled=kernel.database_pooled,
    )
    nats = JetStream(
        kernel,
        connection_name="darkroom-scheduler",
        credentials=NatsCredentials.of(kernel.mesh_dir, "scheduler", "scheduler"),
    )
    mesh = MeshIdentity.of(kernel.mesh_dir, "scheduler")
    server = create_server(settings, mesh)
    parts: list[Part] = [
        Metrics(kernel, "scheduler"),
        Migrations(kernel),
        Closing("database", repo.close),
        nats,
        GrpcServer(server, grace_s=0),
    ]

    async def work() -> None:
        log.info("scheduler running (health on port %d)", server.port)
        scheduler = Scheduler(
            settings,
            repo,
            nats.bus,
            registry,
            stale_after_s=kernel.worker_stale_after_s,
            heartbeat_interval_s=kernel.heartbeat_interval_s,
            mesh=mesh,
        )
        await scheduler.run(stop)

    return await host(parts, work, stop)


def main() -> None:
    run_service("scheduler", serve, SchedulerSettings)
