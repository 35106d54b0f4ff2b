"""The worker's place in the registry: it registers once per start under a new
incarnation, heartbeats its state and telemetry, and deregisters when it stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from gpu_worker.engine import SamplerEngine
from gpu_worker.metrics import WORKER_INFLIGHT
from gpu_worker.tracker import JobTracker
from services.backoff import Backoff
from services.bus.events import Events, JobEvent
from services.config.sections import KernelSettings
from services.db.records import WarmPlan, WorkerHeartbeat
from services.db.repository import Repository
from services.db.states import WorkerKind, WorkerStatus
from services.errors import StoreError, WorkerSuperseded
from services.telemetry import logs
from services.telemetry.gpu import Telemetry
from services.telemetry.metrics import observe_gpu

log = logging.getLogger(__name__)


class Presence:
    def __init__(
        self,
        settings: KernelSettings,
        repo: Repository,
        worker_id: str,
        incarnation: str,
        address: str,
        engine: SamplerEngine,
        telemetry: Telemetry,
        tracker: JobTracker,
        events: Events,
        *,
        on_superseded: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.repo = repo
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.address = address
        self.engine = engine
        self.telemetry = telemetry
        self.tracker = tracker
        self.events = events
        self.status = WorkerStatus.STARTING
        self.plan = WarmPlan(None, ())
        # Set when a newer process took this worker's id: this one must stop.
        self.superseded = asyncio.Event()
        self._on_superseded = on_superseded

    def reading(self) -> WorkerHeartbeat:
        reading = self.telemetry.read()
        inflight = len(self.tracker.running())
        observe_gpu(self.worker_id, reading)
        WORKER_INFLIGHT.labels(worker=self.worker_id).set(inflight)
        return WorkerHeartbeat(
            id=self.worker_id,
            kind=WorkerKind.SAMPLER,
            address=self.address,
            device=reading.name if reading.source == "nvml" else str(self.engine.device),
            models=tuple(self.engine.registry.names()),
            warm_models=tuple(self.engine.warm_models()),
            vram_total_bytes=reading.vram_total_bytes,
            vram_used_bytes=reading.vram_used_bytes,
            temperature_c=reading.temperature_c,
            status=self.status,
            restarts=self.settings.restarts,
            telemetry={
                **reading.as_dict(),
                "inflight": inflight,
                # Measured, for the scheduler's costs: bytes and load seconds per model.
                "models": self.engine.footprints(),
            },
        )

    async def register(self, stop: asyncio.Event) -> bool:
        """Registers this incarnation, waiting for the database if it is away.
        False if ``stop`` was set first."""
        backoff = Backoff()
        while not stop.is_set():
            try:
                registration = await self.repo.workers.register(self.reading(), self.incarnation)
            except StoreError as exc:
                log.warning("cannot register, retrying in %.1fs: %s", backoff.next_s, exc)
                await backoff.wait(stop)
                continue
            self.plan = registration.plan
            if registration.requeued:
                log.warning(
                    "an earlier run of %s held %d jobs; requeued: %s",
                    self.worker_id,
                    len(registration.requeued),
                    ", ".join(registration.requeued),
                    extra=logs.jobs_fields(registration.requeued),
                )
                await self._moved(registration.requeued)
            return True
        return False

    async def beat(self) -> None:
        try:
            self.plan = await self.repo.workers.heartbeat(self.reading(), self.incarnation)
        except WorkerSuperseded as exc:
            log.error("%s; stopping", exc)
            self.superseded.set()
            self._on_superseded()
        except StoreError as exc:
            log.warning("heartbeat failed: %s", exc)

    async def set_status(self, status: WorkerStatus) -> None:
        """Changes the reported state and says so at once."""
        if status != self.status:
            self.status = status
            log.info("%s is %s", self.worker_id, status.value)
            await self.beat()

    async def run(self, until: asyncio.Event) -> None:
        while not until.is_set() and not self.superseded.is_set():
            await self.beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), self.settings.heartbeat_interval_s)

    async def deregister(self) -> None:
        try:
            handed_back = await self.repo.workers.deregister(self.worker_id, self.incarnation)
        except StoreError as exc:
            # Its jobs are requeued once its heartbeat goes stale.
            log.warning("cannot deregister: %s", exc)
            return
        if handed_back:
            log.info(
                "handed back %d jobs: %s",
                len(handed_back),
                ", ".join(handed_back),
                extra=logs.jobs_fields(handed_back),
            )
            await self._moved(handed_back)

    async def _moved(self, job_ids: Sequence[str]) -> None:
        """Jobs went back to the queue: their streams read them, schedulers place them."""
        await self.events.job(*(JobEvent(job_id, 0) for job_id in job_ids))
        await self.events.work()
