"""Small in-memory stand-ins for the database, the bus and the job events, for unit
tests of the sampler's runner and consumer and of worker presence: each records what
was asked of it, and can be told to be away (raise StoreUnavailable) for a while."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from services.bus.events import Events, JobEvent
from services.bus.presence_board import Announcement
from services.db.records import JobRecord, StoredCheckpoint
from services.db.repository import Result, Standing, StartRequest, StepReport
from services.db.states import JobStatus
from services.db.worker_records import Registration, WarmPlan, WorkerHeartbeat
from services.errors import StoreUnavailable


class RecordedEvents(Events):
    """Job events, kept instead of published."""

    def __init__(self) -> None:
        super().__init__(None)
        self.published: list[JobEvent] = []
        self.work_calls = 0

    async def job(self, *events: JobEvent) -> None:
        self.published.extend(events)

    async def work(self) -> None:
        self.work_calls += 1

    def statuses(self, job_id: str) -> list[JobStatus | None]:
        return [e.status for e in self.published if e.job_id == job_id and not e.progress]


class Outage:
    """Away for the next ``calls`` calls (forever: -1)."""

    def __init__(self) -> None:
        self.calls = 0
        self.tried = 0  # calls made, away or not

    def check(self) -> None:
        self.tried += 1
        if self.calls:
            self.calls -= 1
            raise StoreUnavailable("the database is away")


@dataclass
class FakeAttempts:
    """The attempts area: every job it holds is current here unless ``stale`` names it."""

    jobs: dict[str, JobRecord] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)
    standing: Standing = Standing.CURRENT
    outage: Outage = field(default_factory=Outage)  # for finish_many and fail
    finished: list[list[Result]] = field(default_factory=list)
    failed: list[tuple[str, str, bool]] = field(default_factory=list)  # job, error, retryable
    cancelled: list[str] = field(default_factory=list)
    charged: dict[str, float] = field(default_factory=dict)  # what fail and cancel were told it sampled
    handed_back: list[str] = field(default_factory=list)
    progress_calls: list[tuple[str, int, int]] = field(default_factory=list)

    async def start_many(
        self, requests: Sequence[StartRequest], worker_id: str, *, now: datetime
    ) -> dict[str, JobRecord]:
        return {
            r.job_id: replace(self.jobs[r.job_id], status=JobStatus.RUNNING, worker_id=worker_id)
            for r in requests
            if r.job_id in self.jobs and r.job_id not in self.stale
        }

    async def progress_many(self, reports: Sequence[StepReport], worker_id: str) -> dict[str, Standing]:
        self.progress_calls.extend((r.job_id, r.step, r.total) for r in reports)
        return {r.job_id: self.standing for r in reports}

    async def decoding(
        self, jobs: Sequence[tuple[str, int]], worker_id: str, *, now: datetime, sampling_began: datetime | None = None
    ) -> set[str]:
        return {job_id for job_id, _ in jobs}

    async def finish_many(self, results: Sequence[Result], worker_id: str) -> set[str]:
        self.outage.check()
        self.finished.append(list(results))
        return {r.job_id for r in results}

    async def fail(
        self,
        job_id: str,
        attempt: int,
        worker_id: str,
        error: str,
        *,
        retryable: bool,
        now: datetime,
        gpu_seconds: float = 0.0,
    ) -> JobStatus | None:
        self.outage.check()
        self.failed.append((job_id, error, retryable))
        self.charged[job_id] = gpu_seconds
        return JobStatus.QUEUED if retryable else JobStatus.FAILED

    async def cancel(
        self, job_id: str, attempt: int, worker_id: str, *, now: datetime, gpu_seconds: float = 0.0
    ) -> bool:
        self.cancelled.append(job_id)
        self.charged[job_id] = gpu_seconds
        return True

    async def hand_back(self, job_id: str, attempt: int, worker_id: str, *, now: datetime) -> bool:
        self.handed_back.append(job_id)
        return True


@dataclass
class FakeCheckpoints:
    stored: dict[str, StoredCheckpoint] = field(default_factory=dict)
    suspended: list[dict[str, Any]] = field(default_factory=list)
    suspend_asked: dict[str, str] = field(default_factory=dict)  # job id -> why the scheduler asked

    async def save(self, job_id: str, attempt: int, worker_id: str, **saved: Any) -> bool:
        self.stored[job_id] = StoredCheckpoint(job_id, attempt, saved["step"], saved["total"], saved["data"])
        return True

    async def load(self, jobs: Sequence[JobRecord]) -> dict[str, StoredCheckpoint]:
        return {j.id: self.stored[j.id] for j in jobs if j.id in self.stored}

    async def suspend(self, job_id: str, attempt: int, worker_id: str, **suspension: Any) -> JobStatus | None:
        self.suspended.append({"job_id": job_id, **suspension})
        return JobStatus.QUEUED

    async def suspend_reasons(self, job_ids: Sequence[str]) -> dict[str, str]:
        return {j: self.suspend_asked[j] for j in job_ids if j in self.suspend_asked}


@dataclass
class FakeWorkers:
    """The workers registry: ``register_outage`` scripts its answers."""

    requeued: tuple[str, ...] = ()
    handed_back: list[str] = field(default_factory=list)
    register_outage: Outage = field(default_factory=Outage)
    registered: list[tuple[WorkerHeartbeat, str]] = field(default_factory=list)
    deregistered: list[tuple[str, str]] = field(default_factory=list)
    beats_here: list[tuple[str, str]] = field(default_factory=list)  # heartbeats NATS could not take

    async def register(self, hb: WorkerHeartbeat, incarnation: str) -> Registration:
        self.register_outage.check()
        self.registered.append((hb, incarnation))
        return Registration(self.requeued)

    async def heartbeat(self, worker_id: str, incarnation: str) -> None:
        self.beats_here.append((worker_id, incarnation))

    async def deregister(self, worker_id: str, incarnation: str) -> list[str]:
        self.deregistered.append((worker_id, incarnation))
        return list(self.handed_back)


@dataclass
class FakeBoard:
    """The presence bucket: ``errors`` are raised, in turn, by the next heartbeats."""

    stored_plan: WarmPlan | None = None
    errors: list[Exception] = field(default_factory=list)
    beats: list[Announcement] = field(default_factory=list)
    beaten: asyncio.Event = field(default_factory=asyncio.Event)  # set at every heartbeat

    async def announce(self, announcement: Announcement) -> None:
        self.beats.append(announcement)
        self.beaten.set()
        if self.errors:
            raise self.errors.pop(0)

    async def plan(self, worker_id: str) -> WarmPlan | None:
        return self.stored_plan

    async def opened(self) -> FakeBoard:
        return self


@dataclass
class FakeRepository:
    attempts: FakeAttempts = field(default_factory=FakeAttempts)
    checkpoints: FakeCheckpoints = field(default_factory=FakeCheckpoints)
    workers: FakeWorkers = field(default_factory=FakeWorkers)


class FakeMsg:
    """A JetStream message: records how it was settled ("ack", "nak", "nak <delay>", "term")."""

    def __init__(self, data: bytes, reply: str) -> None:
        self.data = data
        self.reply = reply
        self.subject = "darkroom.dispatch.w1"
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak" if delay is None else f"nak {delay}")

    async def term(self) -> None:
        self.settled.append("term")

    async def in_progress(self) -> None:
        pass


class FakeDispatches:
    """A worker's pull subscription and the bus that binds it: each pull takes the next
    delivered chunk, waiting up to its ``wait_s`` for one."""

    def __init__(self) -> None:
        self.chunks: list[list[FakeMsg]] = []
        self.pulls = 0
        self._delivered = asyncio.Event()

    def deliver(self, *msgs: FakeMsg) -> None:
        self.chunks.append(list(msgs))
        self._delivered.set()

    def wake(self) -> None:
        """Ends the pull under way, with nothing."""
        self._delivered.set()

    async def dispatch_consumer(self, worker_id: str, settings: Any) -> FakeDispatches:
        return self

    async def pull(self, n: int, wait_s: float) -> list[FakeMsg]:
        self.pulls += 1
        if not self.chunks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._delivered.wait(), wait_s)
        self._delivered.clear()
        return self.chunks.pop(0) if self.chunks else []

    async def unsubscribe(self) -> None:
        pass


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Waits until ``condition`` holds, failing the test after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.005)
