"""JetStream dispatch: one stream, one subject per worker, one durable consumer each."""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass

import nats
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext

from services.errors import BusError

DISPATCH_STREAM = "DARKROOM_DISPATCH"
DISPATCH_PREFIX = "darkroom.dispatch"
# Publishes with the same message id inside this window are dropped by the server:
# a job re-published for the same attempt is delivered once.
DUPLICATE_WINDOW_S = 120.0
_WORKER_ID = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


def host_token() -> str:
    """This host's name, usable inside a worker id (and so a subject token)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:60]


def dispatch_subject(worker_id: str) -> str:
    if not _WORKER_ID.match(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1-100 of [A-Za-z0-9_-]")
    return f"{DISPATCH_PREFIX}.{worker_id}"


def message_id(job_id: str, attempt: int) -> str:
    return f"{job_id}:{attempt}"


@dataclass(frozen=True)
class Dispatch:
    job_id: str
    attempt: int

    def encode(self) -> bytes:
        return json.dumps({"job_id": self.job_id, "attempt": self.attempt}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Dispatch:
        body = json.loads(data)
        return cls(job_id=str(body["job_id"]), attempt=int(body["attempt"]))


class Bus:
    def __init__(self, nc: nats.NATS, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js

    @classmethod
    async def connect(cls, url: str, *, name: str) -> Bus:
        try:
            nc = await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, drain_timeout=5)
        except (NatsError, OSError) as exc:
            raise BusError(f"cannot connect to NATS at {url}: {exc}") from exc
        bus = cls(nc, nc.jetstream())
        await bus.ensure_stream()
        return bus

    async def ensure_stream(self) -> None:
        config = StreamConfig(
            name=DISPATCH_STREAM,
            subjects=[f"{DISPATCH_PREFIX}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
        )
        try:
            await self.js.add_stream(config)
        except NatsError as exc:
            raise BusError(f"cannot create stream {DISPATCH_STREAM}: {exc}") from exc

    async def publish_dispatch(self, worker_id: str, dispatch: Dispatch) -> bool:
        """Publishes a job to its worker; returns False if JetStream dropped it as a duplicate."""
        try:
            ack = await self.js.publish(
                dispatch_subject(worker_id),
                dispatch.encode(),
                stream=DISPATCH_STREAM,
                headers={"Nats-Msg-Id": message_id(dispatch.job_id, dispatch.attempt)},
                timeout=5,
            )
        except (NatsError, OSError) as exc:
            raise BusError(f"cannot publish {dispatch.job_id} to {worker_id}: {exc}") from exc
        return not ack.duplicate

    async def dispatch_consumer(self, worker_id: str, *, ack_wait_s: float = 60.0) -> JetStreamContext.PullSubscription:
        """The worker's durable pull consumer on its own subject."""
        subject = dispatch_subject(worker_id)
        durable = f"worker-{worker_id}"
        try:
            return await self.js.pull_subscribe(
                subject,
                durable=durable,
                stream=DISPATCH_STREAM,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s, max_ack_pending=64),
            )
        except NatsError as exc:
            raise BusError(f"cannot subscribe to {subject}: {exc}") from exc

    async def close(self) -> None:
        if self.nc.is_connected:
            try:
                await self.nc.drain()
            except NatsError:
                await self.nc.close()
        else:
            await self.nc.close()
