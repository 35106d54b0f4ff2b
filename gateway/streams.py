"""A ``StreamJob`` stream. ``StreamState`` is what one stream has told its client
and what to tell it next: pure, it is fed the job as read from the database and
the events heard on NATS (in any order, some stale, some lost), and says which
status and progress events to send, each status once and in the order the job
went through them. Suspensions and resumptions come from the job's record only
(an event about one makes the stream read it), each sent once. ``follow`` feeds
it: events as they come, the database after a silence, then the result.

Who may speak of a job: the scheduler and the gateways (the control plane), and
the sampler that holds the job's attempt, as the job's record names it (its
worker and attempt, fenced there). A sampler's events name their publisher in
their subject, which a sealed NATS lets each user publish under its own name only;
a step, a preview or a status from any other sampler (or of another attempt) is
never told. One that may be the next attempt's, whose worker the stream has not
read yet, makes it read the job (at most every ``VERIFY_S``) and is told if the
record then names its publisher."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from gateway.convert import STATUS, image_chunks, job_message, suspension
from services.bus.events import CONTROL_PUBLISHERS, Events, JobEvent, position, sampler_publisher
from services.db.records import SUSPENDED, ImageRecord, JobRecord, JobState, SuspendEvent
from services.db.states import JobStatus
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

# A stream that hears nothing of its job for this long reads it from the database:
# events are hints, and one may have been lost.
EVENT_SILENCE_S = 2.0
# Without NATS, a stream reads its job this often.
POLL_S = 0.05
# An event from a sampler the stream does not know to hold the job's attempt makes
# it read the job at most this often: the next attempt's worker is learnt at once,
# and another sampler's forgeries cost at most this many reads, whatever their rate.
VERIFY_S = 0.5
# Untold events kept for that read: a new attempt's steps until it (a sampler's
# forgeries push out the oldest, never more memory).
UNVOUCHED_KEPT = 64


class StreamState:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.status: JobStatus | None = None
        self.attempt = -1
        self.last_step = -1
        self.logged = 0  # entries of the job's suspend_log sent
        # The job's attempt and the publisher that holds it, as last read (None: no
        # worker holds it).
        self.holder: tuple[int, str] | None = None

    @property
    def ended(self) -> bool:
        """The job has ended: its result comes from the database."""
        return self.status is not None and self.status.terminal

    def _moved(self, attempt: int, status: JobStatus) -> pb.JobEvent | None:
        if self.status is not None and position(attempt, status) <= position(self.attempt, self.status):
            return None
        changed = status != self.status
        if attempt != self.attempt:
            self.last_step = -1  # another attempt: its progress starts over
        self.attempt, self.status = attempt, status
        return pb.JobEvent(job_id=self.job_id, status=STATUS[status]) if changed else None

    def on_log(self, log: Sequence[SuspendEvent]) -> list[pb.JobEvent]:
        """The job's suspensions and resumptions as stored: those not yet sent, in
        order (the log only grows)."""
        new = log[self.logged :]
        self.logged = max(self.logged, len(log))
        return [
            pb.JobEvent(job_id=self.job_id, suspended=suspension(e))
            if e.kind == SUSPENDED
            else pb.JobEvent(job_id=self.job_id, resumed=suspension(e))
            for e in new
        ]

    def on_stored(self, status: JobStatus, attempt: int, worker_id: str | None = None) -> pb.JobEvent | None:
        """The job's state as stored: the status to send, if it moved on."""
        self.holder = (attempt, sampler_publisher(worker_id)) if worker_id else None
        return self._moved(attempt, status)

    def _held_attempt(self) -> int:
        return max(self.attempt, self.holder[0] if self.holder is not None else -1)

    def trusts(self, event: JobEvent) -> bool:
        """Whether ``event`` may be told: published by the control plane, or by the
        sampler that holds the job's attempt as last read (of that attempt; any
        change it says to read from the database)."""
        if event.publisher in CONTROL_PUBLISHERS:
            return True
        if self.holder is None or event.publisher != self.holder[1]:
            return False
        return event.attempt == self.holder[0] or (event.status is None and not event.progress)

    def on_event(self, event: JobEvent) -> list[pb.JobEvent]:
        """An event heard on NATS: the status or progress to send, if any (none
        from a publisher it does not trust). A step done says its attempt is
        running, should that event have been lost."""
        if not self.trusts(event):
            return []
        if event.worker and event.publisher in CONTROL_PUBLISHERS and event.attempt >= self._held_attempt():
            # A placement names the attempt's worker, as its record will.
            self.holder = (event.attempt, sampler_publisher(event.worker))
        if event.status is not None:
            moved = self._moved(event.attempt, event.status)
            return [moved] if moved is not None else []
        if not event.progress:
            return []  # the job changed: the caller reads it
        if event.preview:
            if event.attempt != self.attempt or self.status != JobStatus.RUNNING:
                return []  # of an attempt this stream has not seen run, or no longer runs
            width, height = event.size
            preview = pb.Preview(
                step=event.step,
                total=event.total,
                index=event.index,
                data=event.preview,
                mime_type="image/jpeg",
                width=width,
                height=height,
            )
            return [pb.JobEvent(job_id=self.job_id, preview=preview)]
        out = []
        if self.status is None or position(event.attempt, JobStatus.RUNNING) > position(self.attempt, self.status):
            moved = self._moved(event.attempt, JobStatus.RUNNING)
            if moved is not None:
                out.append(moved)
        if event.attempt == self.attempt and self.status == JobStatus.RUNNING and event.step > self.last_step:
            self.last_step = event.step
            out.append(pb.JobEvent(job_id=self.job_id, progress=pb.Progress(step=event.step, total=event.total)))
        return out


async def follow(
    job_id: str,
    events: Events,
    read_state: Callable[[str], Awaitable[JobState]],
    read_result: Callable[[str], Awaitable[tuple[JobRecord, list[ImageRecord]]]],
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[pb.JobEvent]:
    """The job's events until it ends, then its images in chunks and its final state."""
    # Following first, reading second: nothing that happens after the read is missed.
    feed = events.follow(job_id)
    try:
        state = StreamState(job_id)
        stored = await read_state(job_id)
        # Events from publishers not known to hold the job, in order, until the
        # next read says whose are told (a new attempt's first steps among them);
        # and when a read last checked them.
        unvouched: deque[JobEvent] = deque(maxlen=UNVOUCHED_KEPT)
        verified_at = -math.inf
        while True:
            for logged in state.on_log(stored.suspend_log):
                yield logged
            moved = state.on_stored(stored.status, stored.attempt, stored.worker_id)
            if moved is not None:
                yield moved
            while unvouched:
                for out in state.on_event(unvouched.popleft()):  # nothing unless its publisher holds the job now
                    yield out
            # Until the job ends: what NATS says, or what the database says after
            # a silence (an event lost, NATS away) or to vouch for a publisher.
            while not state.ended:
                wait = EVENT_SILENCE_S
                if unvouched:
                    wait = min(wait, max(0.0, verified_at + VERIFY_S - clock()))
                event = await feed.next(wait) if feed is not None else None
                if event is None:
                    if feed is None:
                        await asyncio.sleep(POLL_S)
                    break  # silence, or an event to vouch for: from the database
                if not state.trusts(event):
                    unvouched.append(event)
                    if clock() - verified_at >= VERIFY_S:
                        break
                    continue
                if event.status is None and not event.progress:
                    break  # a change to read: from the database
                for out in state.on_event(event):
                    yield out
            if state.ended:
                break
            if feed is None:  # NATS may be back: follow from before the next read
                feed = events.follow(job_id)
            if unvouched:
                verified_at = clock()
            stored = await read_state(job_id)
        job, images = await read_result(job_id)
        for image in images:
            for chunk in image_chunks(job, image):
                yield chunk
        yield pb.JobEvent(job_id=job.id, terminal=job_message(job))
    finally:
        if feed is not None:
            feed.close()
