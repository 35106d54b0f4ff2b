"""JetStream dispatch: one stream, one subject per worker, one durable consumer each.

Every call here rides out a restart of nats-server: the client reconnects on its
own (forever, with backoff), streams and consumers are file-stored, and errors
leave as ``BusError`` for the caller's loop to retry."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from dataclasses import asdict, dataclass

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from services.backoff import Backoff
from services.bus.connection import BUS_ERRORS, connect_nats
from services.bus.credentials import NatsCredentials
from services.bus.puller import DispatchPuller
from services.errors import BusError, MalformedDispatch
from services.generation import JobShape, Prompts

log = logging.getLogger(__name__)

DISPATCH_STREAM = "DARKROOM_DISPATCH"
DISPATCH_PREFIX = "darkroom.dispatch"
# Publishes with the same message id inside this window are dropped by the server:
# a job re-published for the same attempt is delivered once.
DUPLICATE_WINDOW_S = 120.0
_WORKER_ID = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
# JetStream's "stream name already in use with a different configuration".
_STREAM_NAME_IN_USE = 10058


def host_token() -> str:
    """This host's name, usable inside a worker id (and so a subject token)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:60]


def check_worker_id(worker_id: str) -> str:
    if not _WORKER_ID.match(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1-100 of [A-Za-z0-9_-]")
    return worker_id


def dispatch_subject(worker_id: str) -> str:
    return f"{DISPATCH_PREFIX}.{check_worker_id(worker_id)}"


def consumer_name(worker_id: str) -> str:
    return f"worker-{check_worker_id(worker_id)}"


def message_id(job_id: str, attempt: int) -> str:
    return f"{job_id}:{attempt}"


@dataclass(frozen=True)
class Dispatch:
    job_id: str
    attempt: int
    # When the scheduler published it (its clock, seconds since the epoch); 0: not said.
    published_at: float = 0.0
    # The scheduling pass that placed it, and how many jobs that pass sent this
    # worker: a worker holding some of them waits for the rest before it forms a
    # batch, and for nothing else. "" and 0: not said.
    pass_id: str = ""
    pass_jobs: int = 0
    shape: JobShape | None = None  # None: not said; the job runs alone
    # Its prompt and negative prompt as its sampler encodes them, so that they are
    # encoded while its start is written; None: not said (the start's record says).
    prompts: Prompts | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "job_id": self.job_id,
                "attempt": self.attempt,
                "published_at": self.published_at,
                "pass_id": self.pass_id,
                "pass_jobs": self.pass_jobs,
                "shape": asdict(self.shape) if self.shape is not None else None,
                "prompts": [self.prompts.prompt, self.prompts.negative_prompt] if self.prompts is not None else None,
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Dispatch:
        try:
            body = json.loads(data)
            job_id, attempt = body["job_id"], body["attempt"]
            published_at = body.get("published_at", 0.0)
            pass_id, pass_jobs = body.get("pass_id", ""), body.get("pass_jobs", 0)
            if not isinstance(job_id, str) or not job_id or not isinstance(attempt, int) or attempt < 1:
                raise ValueError("job_id must be a non-empty string and attempt a positive integer")
            if not isinstance(published_at, int | float) or published_at < 0:
                raise ValueError("published_at must be a non-negative number")
            if not isinstance(pass_id, str) or not isinstance(pass_jobs, int) or pass_jobs < 0:
                raise ValueError("pass_id must be a string and pass_jobs a non-negative integer")
            shape = JobShape(**body["shape"]) if body.get("shape") is not None else None
            prompts = body.get("prompts")
            if prompts is not None:
                if not isinstance(prompts, list) or len(prompts) != 2 or not all(isinstance(p, str) for p in prompts):
                    raise ValueError("prompts must be [prompt, negative_prompt]")
                prompts = Prompts(*prompts)
        except (ValueError, TypeError, KeyError) as exc:
            raise MalformedDispatch(f"malformed dispatch {data[:200]!r}: {exc}") from exc
        return cls(job_id, attempt, float(published_at), pass_id, pass_jobs, shape, prompts)


@dataclass(frozen=True)
class ConsumerSettings:
    ack_wait_s: float = 30.0
    max_ack_pending: int = 64


class Bus:
    def __init__(self, nc: nats.NATS, js: JetStreamContext, *, replicas: int = 1) -> None:
        self.nc = nc
        self.js = js
        self.replicas = replicas

    @classmethod
    async def connect(
        cls,
        servers: list[str],
        *,
        name: str,
        replicas: int = 1,
        credentials: NatsCredentials | None = None,
        manages_stream: bool = True,
        stop: asyncio.Event | None = None,
        retry_max_s: float = 5.0,
    ) -> Bus:
        """Connects, retrying with backoff until NATS answers (or ``stop`` is set),
        so that a service started before nats-server, or during its restart, waits
        for it rather than exits. The stream is made (or brought to this
        configuration) by those that ``manages_stream``: the schedulers; a sampler
        may not touch it."""
        backoff = Backoff(max_s=retry_max_s)
        while True:
            nc = await connect_nats(servers, name=name, credentials=credentials, stop=stop, retry_max_s=retry_max_s)
            try:
                bus = cls(nc, nc.jetstream(timeout=5), replicas=replicas)
                if manages_stream:
                    await bus.ensure_stream()
                return bus
            except BusError as exc:
                await nc.close()
                if stop is not None and stop.is_set():
                    raise
                log.warning("JetStream at %s not ready (%s); retrying in %.1fs", ",".join(servers), exc, backoff.next_s)
                await backoff.wait()

    async def ensure_stream(self) -> None:
        config = StreamConfig(
            name=DISPATCH_STREAM,
            subjects=[f"{DISPATCH_PREFIX}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=self.replicas,
        )
        try:
            try:
                await self.js.add_stream(config)
            except BadRequestError as exc:
                if exc.err_code != _STREAM_NAME_IN_USE:
                    raise
                await self.js.update_stream(config)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot create stream {DISPATCH_STREAM}: {exc}") from exc

    async def publish_dispatches(self, dispatches: list[tuple[str, Dispatch]], *, timeout_s: float = 5.0) -> None:
        """Publishes (worker id, dispatch) pairs all at once and waits for JetStream
        to have taken every one (a duplicate, dropped, counts as taken)."""
        try:
            acks = [
                await self.js.publish_async(
                    dispatch_subject(worker_id),
                    dispatch.encode(),
                    stream=DISPATCH_STREAM,
                    headers={"Nats-Msg-Id": message_id(dispatch.job_id, dispatch.attempt)},
                )
                for worker_id, dispatch in dispatches
            ]
            await asyncio.wait_for(asyncio.gather(*acks), timeout_s)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot publish {len(dispatches)} dispatches: {exc}") from exc

    async def dispatch_consumer(self, worker_id: str, settings: ConsumerSettings) -> DispatchPuller:
        """The worker's durable pull consumer on its own subject, created, or updated
        to ``settings`` if it exists with others (a restarted worker takes back its
        own consumer, and what is waiting on it)."""
        subject = dispatch_subject(worker_id)
        durable = consumer_name(worker_id)
        config = ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=settings.ack_wait_s,
            max_ack_pending=settings.max_ack_pending,
        )
        try:
            # CONSUMER.CREATE with an existing name updates it (nats-server 2.10+).
            await self.js.add_consumer(DISPATCH_STREAM, config)
            return await DispatchPuller.bind(self.nc, DISPATCH_STREAM, durable)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot subscribe to {subject}: {exc}") from exc

    async def consumer_settings(self, worker_id: str) -> ConsumerSettings:
        try:
            info = await self.js.consumer_info(DISPATCH_STREAM, consumer_name(worker_id))
        except BUS_ERRORS as exc:
            raise BusError(f"cannot read the consumer of {worker_id}: {exc}") from exc
        return ConsumerSettings(
            ack_wait_s=info.config.ack_wait or 0.0, max_ack_pending=info.config.max_ack_pending or 0
        )

    async def forget_worker(self, worker_id: str) -> None:
        """Deletes a worker's consumer and whatever is left on its subject: it is
        gone for good, and its jobs were requeued."""
        try:
            try:
                await self.js.delete_consumer(DISPATCH_STREAM, consumer_name(worker_id))
            except NotFoundError:
                pass
            await self.js.purge_stream(DISPATCH_STREAM, subject=dispatch_subject(worker_id))
        except BUS_ERRORS as exc:
            raise BusError(f"cannot forget worker {worker_id}: {exc}") from exc

    async def close(self) -> None:
        if self.nc.is_connected:
            try:
                await self.nc.drain()
            except BUS_ERRORS:
                await self.nc.close()
        else:
            await self.nc.close()
