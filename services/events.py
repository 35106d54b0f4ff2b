"""Job events on core NATS: how a stream learns at once that its job moved on.

Whoever changes a job's state in the database (the gateway, the scheduler, a
sampler) publishes the change on ``darkroom.job.<job id>`` after the commit, and a
sampler publishes every denoising step there too. The database stays the truth:
events are hints, published at most once, lost while NATS is away; a stream reads
the job when it opens, re-reads it when it hears nothing for a while, and takes the
result from the database. ``darkroom.work`` tells schedulers there may be work to
place (a job was submitted or requeued, a worker freed a slot), so that a pass
starts at once rather than at the next tick."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError

from services.bus import BUS_ERRORS
from services.db.states import JobStatus
from services.errors import BusError

log = logging.getLogger("darkroom.events")

JOB_PREFIX = "darkroom.job"
WORK_SUBJECT = "darkroom.work"
# A job id usable as a subject token (no wildcards, no separators).
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
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

    @property
    def progress(self) -> bool:
        return self.status is None and self.total > 0

    def encode(self) -> bytes:
        body: dict[str, object] = {"attempt": self.attempt}
        if self.status is not None:
            body["status"] = self.status.value
        elif self.total:
            body.update(step=self.step, total=self.total)
        return json.dumps(body).encode()

    @classmethod
    def decode(cls, job_id: str, data: bytes) -> JobEvent:
        """Raises ValueError for a message that is not a job event."""
        try:
            body = json.loads(data)
            attempt = int(body["attempt"])
            if "status" in body:
                return cls(job_id, attempt, JobStatus(body["status"]))
            return cls(job_id, attempt, step=int(body.get("step", 0)), total=int(body.get("total", 0)))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a job event: {data[:100]!r}") from exc


def job_subject(job_id: str) -> str:
    if not _TOKEN.match(job_id):
        raise ValueError(f"job id {job_id!r} is not a subject token")
    return f"{JOB_PREFIX}.{job_id}"


class JobFeed:
    """The events of one job, from the moment it was opened."""

    def __init__(self, job_id: str, sub: Subscription) -> None:
        self.job_id = job_id
        self._sub = sub

    async def next(self, timeout_s: float) -> JobEvent | None:
        """The next event, or None after ``timeout_s`` of silence."""
        while True:
            try:
                msg = await self._sub.next_msg(timeout=timeout_s)
            except (NatsTimeoutError, TimeoutError):
                return None
            except BUS_ERRORS:
                return None
            try:
                return JobEvent.decode(self.job_id, msg.data)
            except ValueError as exc:
                log.warning("%s", exc)

    async def close(self) -> None:
        try:
            await self._sub.unsubscribe()
        except BUS_ERRORS:
            pass


class Events:
    """Publishing and following job events over a NATS connection (None: NATS is not
    there yet, and every call does nothing)."""

    def __init__(self, nc: nats.NATS | None = None) -> None:
        self.nc = nc

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def job(self, *events: JobEvent) -> None:
        """Publishes after the change they report was committed."""
        if self.nc is None:
            return
        try:
            for event in events:
                await self.nc.publish(job_subject(event.job_id), event.encode())
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

    async def follow(self, job_id: str) -> JobFeed | None:
        """Subscribes to the job's events, confirmed by the server so that nothing
        published from now on is missed; None when NATS cannot be asked now."""
        if not self.connected or not _TOKEN.match(job_id):
            return None
        assert self.nc is not None
        try:
            sub = await self.nc.subscribe(job_subject(job_id))
        except BUS_ERRORS as exc:
            log.debug("cannot follow %s: %s", job_id, exc)
            return None
        feed = JobFeed(job_id, sub)
        try:
            await self.nc.flush(timeout=1)
        except BUS_ERRORS as exc:
            log.debug("cannot follow %s: %s", job_id, exc)
            await feed.close()
            return None
        return feed

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
