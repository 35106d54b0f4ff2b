"""Job events on core NATS: how a stream learns at once that its job moved on.

Whoever changes a job's state in the database (the gateway, the scheduler, a
sampler) publishes the change on ``darkroom.job.<job id>.<publisher>`` after the
commit, and a sampler publishes every denoising step there too (and its previews).
The publisher is the name of the process's NATS user (``scheduler``, ``gateway``,
``sampler-<worker id>``): a sealed NATS lets each user publish under its own name
only, so a subscriber knows who spoke. The database stays the truth: events are
hints, published at most once, lost while NATS is away; a stream reads the job when
it opens, re-reads it when it hears nothing for a while, takes the result from the
database, and tells its client a sampler's events only when that sampler holds the
job's attempt (``gateway/streams.py``). ``darkroom.work`` tells schedulers there
may be work to place (a job was submitted or requeued, a worker freed a slot), so
that a pass starts at once rather than at the next tick."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
from dataclasses import dataclass

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.bus.connection import BUS_ERRORS
from services.db.states import JobStatus
from services.errors import BusError

log = logging.getLogger(__name__)

JOB_PREFIX = "darkroom.job"
WORK_SUBJECT = "darkroom.work"
# A job id usable as a subject token (no wildcards, no separators).
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A publisher's name: its NATS user, a subject token too.
_PUBLISHER = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# The control plane's publishers, whose events about any job are told as heard.
CONTROL_PUBLISHERS = frozenset({"scheduler", "gateway"})
SAMPLER_PUBLISHER_PREFIX = "sampler-"
# Within an attempt a job goes SCHEDULED, RUNNING, DECODING, then back to QUEUED (a
# requeue) or to its end; the next attempt starts over. So (attempt, rank) orders a
# job's states as the database saw them, whichever process reported each.
_RANK = {
    JobStatus.SCHEDULED: 1,
    JobStatus.RUNNING: 2,
    JobStatus.DECODING: 3,
    JobStatus.QUEUED: 4,
}
_TERMINAL_RANK = 5


def position(attempt: int, status: JobStatus) -> tuple[int, int]:
    """Where ``status`` of ``attempt`` stands in its job's life: a later state
    compares greater, so a stale or reordered event can be recognised and dropped."""
    return attempt, _TERMINAL_RANK if status.terminal else _RANK[status]


def sampler_publisher(worker_id: str) -> str:
    """The name a sampler publishes under: its NATS user's."""
    return f"{SAMPLER_PUBLISHER_PREFIX}{worker_id}"


@dataclass(frozen=True)
class JobEvent:
    """A job's state changed to ``status``; or a denoising step of ``total`` was
    done; or (neither) it changed in a way its publisher did not read back, and a
    stream should read it from the database."""

    job_id: str
    attempt: int
    status: JobStatus | None = None
    step: int = 0
    total: int = 0
    # A rough preview of image ``index`` at ``step`` (a JPEG of ``size``), for its streams.
    preview: bytes = b""
    index: int = 0
    size: tuple[int, int] = (0, 0)
    # The worker a placement gave the attempt (the scheduler's SCHEDULED): a stream
    # then trusts that worker's events of it without reading the job first.
    worker: str = ""
    # Who published it, as its subject names it ('' if it names no one): not part
    # of the message, so a publisher cannot claim another's name beyond what NATS lets it.
    publisher: str = ""

    @property
    def progress(self) -> bool:
        return self.status is None and self.total > 0

    def encode(self) -> bytes:
        body: dict[str, object] = {"attempt": self.attempt}
        if self.status is not None:
            body["status"] = self.status.value
            if self.worker:
                body["worker"] = self.worker
        elif self.total:
            body.update(step=self.step, total=self.total)
        if self.preview:
            body.update(preview=base64.b64encode(self.preview).decode(), index=self.index, size=list(self.size))
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, job_id: str, data: bytes, publisher: str = "") -> JobEvent:
        """Raises ValueError for a message that is not a job event."""
        try:
            body = json.loads(data)
            attempt = int(body["attempt"])
            if "status" in body:
                worker = str(body.get("worker", ""))
                return cls(job_id, attempt, JobStatus(body["status"]), worker=worker, publisher=publisher)
            step, total = int(body.get("step", 0)), int(body.get("total", 0))
            if "preview" in body:
                width, height = (int(v) for v in body["size"])
                preview = base64.b64decode(body["preview"], validate=True)
                return cls(
                    job_id,
                    attempt,
                    step=step,
                    total=total,
                    preview=preview,
                    index=int(body["index"]),
                    size=(width, height),
                    publisher=publisher,
                )
            return cls(job_id, attempt, step=step, total=total, publisher=publisher)
        except (KeyError, TypeError, AttributeError, ValueError, binascii.Error) as exc:
            raise ValueError(f"not a job event: {data[:100]!r}") from exc


def job_subject(job_id: str, publisher: str) -> str:
    """Where ``publisher`` publishes the job's events."""
    if not _TOKEN.match(job_id):
        raise ValueError(f"job id {job_id!r} is not a subject token")
    if not _PUBLISHER.match(publisher):
        raise ValueError(f"publisher {publisher!r} is not a subject token")
    return f"{JOB_PREFIX}.{job_id}.{publisher}"


def parse_subject(subject: str) -> tuple[str, str]:
    """The job id and the publisher a job event's subject names (publisher '' for a
    subject of no publisher, as published before publishers were named)."""
    job_id, _, publisher = subject.removeprefix(f"{JOB_PREFIX}.").partition(".")
    return job_id, publisher


class JobFeed:
    """The events of one job, from the moment it was opened."""

    def __init__(self, job_id: str, followers: dict[str, list[JobFeed]]) -> None:
        self.job_id = job_id
        self._queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._followers = followers
        followers.setdefault(job_id, []).append(self)

    def put(self, event: JobEvent) -> None:
        self._queue.put_nowait(event)

    async def next(self, timeout_s: float) -> JobEvent | None:
        """The next event, or None after ``timeout_s`` of silence."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            return None

    def close(self) -> None:
        feeds = self._followers.get(self.job_id, [])
        if self in feeds:
            feeds.remove(self)
        if not feeds:
            self._followers.pop(self.job_id, None)


class Events:
    """Publishing and following job events over a NATS connection (None: NATS is not
    there yet, and every call does nothing), publishing as ``publisher`` (the
    process's NATS user; '' for one that only follows).

    A process that follows jobs (the gateway) subscribes once to every job's events
    and hands each to the streams of its job: a stream begins following without a
    round trip to the server, and misses nothing published from then on."""

    def __init__(self, nc: nats.NATS | None = None, *, publisher: str = "") -> None:
        self.nc = nc
        self.publisher = publisher
        self._followers: dict[str, list[JobFeed]] = {}
        self._routing: Subscription | None = None

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def job(self, *events: JobEvent) -> None:
        """Publishes after the change they report was committed."""
        if self.nc is None:
            return
        try:
            for event in events:
                await self.nc.publish(job_subject(event.job_id, self.publisher), event.encode())
        except (*BUS_ERRORS, ValueError) as exc:
            log.debug("job events not published: %s", exc)

    async def work(self) -> None:
        """Tells schedulers there may be work to place."""
        if self.nc is None:
            return
        try:
            await self.nc.publish(WORK_SUBJECT, b"")
        except BUS_ERRORS as exc:
            log.debug("work event not published: %s", exc)

    async def route(self) -> None:
        """Subscribes to every job's events, for ``follow`` (the subscription lives as
        long as the connection, across reconnects)."""
        if self.nc is None or self._routing is not None:
            return

        async def arrived(msg: Msg) -> None:
            job_id, publisher = parse_subject(msg.subject)
            feeds = self._followers.get(job_id)
            if not feeds:
                return  # nobody here follows that job
            try:
                event = JobEvent.decode(job_id, msg.data, publisher)
            except ValueError as exc:
                log.warning("%s", exc)
                return
            for feed in feeds:
                feed.put(event)

        try:
            self._routing = await self.nc.subscribe(f"{JOB_PREFIX}.>", cb=arrived)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot subscribe to job events: {exc}") from exc

    def follow(self, job_id: str) -> JobFeed | None:
        """The job's events from now on; None while they cannot be heard (NATS away,
        or not routed here): the caller reads the job instead."""
        if self._routing is None or not self.connected or not _TOKEN.match(job_id):
            return None
        return JobFeed(job_id, self._followers)

    async def on_work(self, wake: asyncio.Event) -> None:
        """Sets ``wake`` whenever there may be work to place (the subscription lives
        as long as the connection, across reconnects)."""
        if self.nc is None:
            return

        async def woken(_msg: Msg) -> None:
            wake.set()

        try:
            await self.nc.subscribe(WORK_SUBJECT, cb=woken)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot subscribe to {WORK_SUBJECT}: {exc}") from exc
