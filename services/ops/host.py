"""One host for every service, as Celery's bootsteps: a service lists the parts it
needs in the order they need each other (its metrics endpoint, the migrations, the
database, NATS, its gRPC server, its presence in the registry); the host starts
them in that order, runs the service's work, and once that ends (on the stop
event, or by itself) stops the parts it started, in reverse. A part that waits for
something away (the database, NATS) gives up when the stop event is set, and the
service then stops without having started its work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import nats

from services.bus.connection import connect_nats
from services.bus.credentials import NatsCredentials
from services.bus.dispatch import Bus
from services.bus.events import Events
from services.bus.presence_board import BoardOnConnection
from services.config.sections import KernelSettings
from services.db.migrate import schema_when_ready, upgrade_when_reachable
from services.errors import BusError
from services.presence import Presence
from services.presence_view import PresenceView, follow
from services.rpc.server import Server
from services.telemetry.metrics import serve_metrics

log = logging.getLogger(__name__)


class Part(Protocol):
    name: str

    async def start(self, stop: asyncio.Event) -> bool:
        """Starts; False if ``stop`` was set before it could."""
        ...

    async def stop(self) -> None: ...


async def host(parts: Sequence[Part], work: Callable[[], Awaitable[int | None]], stop: asyncio.Event) -> int:
    """Starts ``parts`` in order, runs ``work``, stops the parts started in reverse;
    returns ``work``'s exit code (0 when it never ran)."""
    started: list[Part] = []
    try:
        for part in parts:
            if not await part.start(stop):
                log.info("stopped while starting %s", part.name)
                return 0
            started.append(part)
        return await work() or 0
    finally:
        for part in reversed(started):
            try:
                await part.stop()
            except Exception:
                log.exception("stopping %s failed; stopping the rest", part.name)


class Metrics:
    """Prometheus ``/metrics`` on the kernel's metrics port, from a thread."""

    name = "metrics"

    def __init__(self, kernel: KernelSettings, service: str) -> None:
        self.kernel, self.service = kernel, service

    async def start(self, stop: asyncio.Event) -> bool:
        serve_metrics(self.kernel, self.service)
        return True

    async def stop(self) -> None:
        """Left serving until the process exits: its last scrape sees the stop."""


class Migrations:
    """The schema brought to the newest; through a transaction pooler
    (``database_pooled``), waited for instead: a migration never goes through one."""

    name = "migrations"

    def __init__(self, kernel: KernelSettings) -> None:
        self.database_url = kernel.database_url
        self.pooled = kernel.database_pooled

    async def start(self, stop: asyncio.Event) -> bool:
        if self.pooled:
            return await schema_when_ready(self.database_url, stop)
        return await upgrade_when_reachable(self.database_url, stop)

    async def stop(self) -> None:
        pass


class Closing:
    """Something that needs nothing to start and must be closed at the end (the
    repository's connections, a client's channels)."""

    def __init__(self, name: str, close: Callable[[], Awaitable[None]]) -> None:
        self.name, self.close = name, close

    async def start(self, stop: asyncio.Event) -> bool:
        return True

    async def stop(self) -> None:
        await self.close()


class JetStream:
    """NATS with JetStream (dispatch), waited for until it answers."""

    name = "nats"

    def __init__(
        self,
        kernel: KernelSettings,
        *,
        connection_name: str,
        events: Events | None = None,
        credentials: NatsCredentials | None = None,
        manages_stream: bool = True,
    ) -> None:
        self.servers, self.replicas, self.connection_name = kernel.nats_servers, kernel.nats_replicas, connection_name
        self.events = events  # job events, published over the same connection once it is made
        self.credentials, self.manages_stream = credentials, manages_stream
        self._bus: Bus | None = None

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, "the NATS part has not started"
        return self._bus

    def connection(self) -> nats.NATS | None:
        """The connection, once the part has started."""
        return self._bus.nc if self._bus is not None else None

    async def start(self, stop: asyncio.Event) -> bool:
        try:
            self._bus = await Bus.connect(
                self.servers,
                name=self.connection_name,
                replicas=self.replicas,
                credentials=self.credentials,
                manages_stream=self.manages_stream,
                stop=stop,
            )
        except BusError:
            if stop.is_set():
                return False
            raise
        if self.events is not None:
            self.events.nc = self._bus.nc
        return True

    async def stop(self) -> None:
        if self._bus is not None:
            await self._bus.close()


class EventsInBackground:
    """Job events on core NATS for a service that serves without them: it starts at
    once, and events flow once NATS answers."""

    name = "job events"

    def __init__(
        self,
        kernel: KernelSettings,
        events: Events,
        *,
        connection_name: str,
        credentials: NatsCredentials | None = None,
        presence: PresenceView | None = None,
    ) -> None:
        self.servers, self.events, self.connection_name = kernel.nats_servers, events, connection_name
        self.replicas = kernel.nats_replicas
        self.credentials = credentials
        self.presence = presence  # kept up to date from the presence bucket once NATS answers
        self._connecting: asyncio.Task[None] | None = None

    async def start(self, stop: asyncio.Event) -> bool:
        async def connect() -> None:
            with contextlib.suppress(BusError):
                nc = self.events.nc = await connect_nats(
                    self.servers, name=self.connection_name, credentials=self.credentials, stop=stop
                )
                await self.events.route()
                if self.presence is not None:
                    # Only the scheduler creates the bucket in a sealed mesh.
                    board = BoardOnConnection(lambda: nc, replicas=self.replicas, create=self.credentials is None)
                    await follow(self.presence, nc, board, stop)

        if self.servers:
            self._connecting = asyncio.create_task(connect())
        return True

    async def stop(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self.events.nc is not None:
            await self.events.nc.close()


class GrpcServer:
    """A gRPC server, serving health checks as SERVING once started; stopping, it
    says NOT_SERVING, then gives calls under way ``grace_s`` to end."""

    name = "gRPC server"

    def __init__(self, server: Server, *, grace_s: float) -> None:
        self.server, self.grace_s = server, grace_s

    async def start(self, stop: asyncio.Event) -> bool:
        await self.server.grpc.start()
        await self.server.set_serving(True)
        return True

    async def stop(self) -> None:
        await self.server.set_serving(False)
        await self.server.grpc.stop(self.grace_s)


class Registered:
    """A worker's place in the registry: registered once the database answers,
    deregistered at the end (not when a newer process took its id: the row is
    that one's now)."""

    name = "registration"

    def __init__(self, presence: Presence) -> None:
        self.presence = presence

    async def start(self, stop: asyncio.Event) -> bool:
        return await self.presence.register(stop)

    async def stop(self) -> None:
        if not self.presence.superseded.is_set():
            await self.presence.deregister()
