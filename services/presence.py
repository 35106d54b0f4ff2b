"""A worker's place in the registry, the same for samplers and decoders: it registers
once per start under a new incarnation in PostgreSQL (waiting for the database
while it is away), heartbeats on an interval on NATS (the presence bucket,
``services.bus.presence_board``: a heartbeat never touches the database), says at
once when its status changes, notices when a newer process has taken its id
(``WorkerSuperseded``: this one must stop), and deregisters in PostgreSQL when it
stops. What a heartbeat says is the kind's own: a function
builds it for the status the worker is in.

Jobs that went back to the queue as it registered (an earlier run held them) or
deregistered (it held them) are published, so that their streams read them and
schedulers place them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.backoff import Backoff
from services.bus.events import Events, JobEvent
from services.bus.presence_board import Announcement
from services.config.fields import SettingsError
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import Registration, WarmPlan, WorkerHeartbeat
from services.errors import BusError, StoreError, WorkerIdTaken, WorkerSuperseded
from services.models.registry import ModelRegistry
from services.telemetry import logs
from services.telemetry.gpu import Telemetry
from services.telemetry.metrics import observe_gpu

log = logging.getLogger(__name__)


class ModelHolder(Protocol):
    """A worker's engine, as its heartbeat reads it."""

    @property
    def device(self) -> object: ...

    @property
    def registry(self) -> ModelRegistry: ...

    def warm_models(self) -> list[str]: ...

    def served_models(self) -> list[str]:
        """The registry's models it can run here."""
        ...


@dataclass(frozen=True)
class Heartbeat:
    """What a worker of ``kind`` says in each heartbeat: its card (named as NVML
    names it, else by its engine's torch device), the models it can run and those
    it holds, and the card's telemetry with the kind's own (``own``, read at each
    beat)."""

    kind: WorkerKind
    worker_id: str
    address: str
    engine: ModelHolder
    card: Telemetry
    restarts: int
    own: Callable[[], Mapping[str, Any]] = dict

    def __call__(self, status: WorkerStatus) -> WorkerHeartbeat:
        reading = self.card.read()
        observe_gpu(self.worker_id, reading)
        served = self.engine.served_models()
        return WorkerHeartbeat(
            id=self.worker_id,
            kind=self.kind,
            address=self.address,
            device=reading.name if reading.source == "nvml" else str(self.engine.device),
            models=tuple(served),
            capabilities=tuple(sorted({self.engine.registry.get(m).capability for m in served})),
            warm_models=tuple(self.engine.warm_models()),
            vram_total_bytes=reading.vram_total_bytes,
            vram_used_bytes=reading.vram_used_bytes,
            temperature_c=reading.temperature_c,
            status=status,
            restarts=self.restarts,
            telemetry={**reading.as_dict(), **self.own()},
        )


class WorkerRegistry(Protocol):
    """The repository's ``workers`` area, as far as presence needs it: the durable
    part (a start and a stop), never a heartbeat."""

    async def register(self, hb: WorkerHeartbeat, incarnation: str) -> Registration: ...

    async def heartbeat(self, worker_id: str, incarnation: str) -> None: ...

    async def deregister(self, worker_id: str, incarnation: str) -> list[str]: ...


class Board(Protocol):
    """Where heartbeats go (``services.bus.presence_board.PresenceBoard``)."""

    async def announce(self, announcement: Announcement) -> None: ...

    async def plan(self, worker_id: str) -> WarmPlan | None: ...


def _never_mind() -> None:
    pass


@dataclass(eq=False)
class Presence:
    workers: WorkerRegistry
    board: Callable[[], Awaitable[Board]]  # where heartbeats go (NATS), once connected
    worker_id: str
    heartbeat: Callable[[WorkerStatus], WorkerHeartbeat]
    events: Events
    interval_s: float
    status: WorkerStatus = WorkerStatus.STARTING
    on_superseded: Callable[[], None] = _never_mind
    reads_plan: bool = False  # a sampler follows the warm plan the scheduler stores for it
    incarnation: str = field(default_factory=lambda: str(uuid.uuid4()), init=False)
    started_at: float = field(default_factory=time.time, init=False)
    plan: WarmPlan = field(default=WarmPlan(None, ()), init=False)  # what the scheduler wants warm here (samplers)
    # Set when a newer process took this worker's id: this one must stop.
    superseded: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    async def register(self, stop: asyncio.Event) -> bool:
        """Registers this incarnation, waiting for the database if it is away.
        False if ``stop`` was set first. Raises SettingsError if a worker of the
        other kind holds this worker's id: waiting would not change that."""
        backoff = Backoff()
        while not stop.is_set():
            try:
                registration = await self.workers.register(self.heartbeat(self.status), self.incarnation)
            except WorkerIdTaken as exc:
                raise SettingsError(f"{exc}: give each worker its own DARKROOM_WORKER_ID") from exc
            except StoreError as exc:
                log.warning("cannot register, retrying in %.1fs: %s", backoff.next_s, exc)
                await backoff.wait(stop)
                continue
            self.started_at = time.time()
            await self.beat()  # heard of at once, not an interval later
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
        """One heartbeat on NATS (and, for a sampler, its warm plan read back)."""
        announcement = Announcement(self.heartbeat(self.status), self.incarnation, self.started_at)
        try:
            board = await self.board()
            await board.announce(announcement)
            if self.reads_plan:
                plan = await board.plan(self.worker_id)
                if plan is not None:
                    self.plan = plan
        except WorkerSuperseded as exc:
            log.error("%s; stopping", exc)
            self.superseded.set()
            self.on_superseded()
        except BusError as exc:
            await self._beat_in_database(exc)

    async def _beat_in_database(self, why: BusError) -> None:
        """NATS cannot take the heartbeat: PostgreSQL is told instead, so that the
        scheduler does not take this worker for dead while its NATS is away."""
        try:
            await self.workers.heartbeat(self.worker_id, self.incarnation)
        except WorkerSuperseded as exc:
            log.error("%s; stopping", exc)
            self.superseded.set()
            self.on_superseded()
        except StoreError as exc:
            log.warning("heartbeat failed on NATS (%s) and in the database (%s)", why, exc)
        else:
            log.warning("heartbeat failed on NATS, told the database instead: %s", why)

    async def set_status(self, status: WorkerStatus) -> None:
        """Changes the reported status and says so at once."""
        if status != self.status:
            self.status = status
            log.info("%s is %s", self.worker_id, status.value)
            await self.beat()

    async def run(self, until: asyncio.Event) -> None:
        """Heartbeats every ``interval_s`` until ``until`` is set or the worker is superseded."""
        while not until.is_set() and not self.superseded.is_set():
            await self.beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), self.interval_s)

    async def deregister(self) -> None:
        self.status = WorkerStatus.GONE
        await self.beat()  # presence hears at once that it stopped
        try:
            handed_back = await self.workers.deregister(self.worker_id, self.incarnation)
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
