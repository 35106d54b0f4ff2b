"""A ``StreamJob`` stream. ``StreamState`` is what one stream has told its client
and what to tell it next: pure, it is fed the job as read from the database and
the events heard on NATS (in any order, some stale, some lost), and says which
status and progress events to send, each status once and in the order the job
went through them. Suspensions and resumptions come from the job's record only
(an event about one makes the stream read it), each sent once. ``follow`` feeds
it: events as they come, the database after a silence, then the result."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from gateway.convert import STATUS, image_chunks, job_message, suspension
from services.bus.events import Events, JobEvent, position
from services.db.records import SUSPENDED, ImageRecord, JobRecord, JobState, SuspendEvent
from services.db.states import JobStatus
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

# A stream that hears nothing of its job for this long reads it from the database:
# events are hints, and one may have been lost.
EVENT_SILENCE_S = 2.0
# Without NATS, a stream reads its job this often.
POLL_S = 0.05


class StreamState:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.status: JobStatus | None = None
        self.attempt = -1
        self.last_step = -1
        self.logged = 0  # entries of the job's suspend_log sent

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

    def on_stored(self, status: JobStatus, attempt: int) -> pb.JobEvent | None:
        """The job's state as stored: the status to send, if it moved on."""
        return self._moved(attempt, status)

    def on_event(self, event: JobEvent) -> list[pb.JobEvent]:
        """An event heard on NATS: the status or progress to send, if any. A step
        done says its attempt is running, should that event have been lost."""
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
) -> AsyncIterator[pb.JobEvent]:
    """The job's events until it ends, then its images in chunks and its final state."""
    # Following first, reading second: nothing that happens after the read is missed.
    feed = events.follow(job_id)
    try:
        state = StreamState(job_id)
        stored = await read_state(job_id)
        while True:
            for logged in state.on_log(stored.suspend_log):
                yield logged
            moved = state.on_stored(stored.status, stored.attempt)
            if moved is not None:
                yield moved
            # Until the job ends: what NATS says, or what the database says after
            # a silence (an event lost, NATS away).
            while not state.ended:
                event = await feed.next(EVENT_SILENCE_S) if feed is not None else None
                if event is None or (event.status is None and not event.progress):
                    if feed is None:
                        await asyncio.sleep(POLL_S)
                    break  # silence, or a change to read: from the database
                for out in state.on_event(event):
                    yield out
            if state.ended:
                break
            if feed is None:  # NATS may be back: follow from before the next read
                feed = events.follow(job_id)
            stored = await read_state(job_id)
        job, images = await read_result(job_id)
        for image in images:
            for chunk in image_chunks(job, image):
                yield chunk
        yield pb.JobEvent(job_id=job.id, terminal=job_message(job))
    finally:
        if feed is not None:
            feed.close()
