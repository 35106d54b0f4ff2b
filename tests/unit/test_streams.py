"""What a StreamJob stream tells its client, from the job as stored and the events
heard on NATS in any order: each status once, in the order the job went through
them, progress only for the attempt that runs, and only what the control plane or
the sampler holding the job's attempt published."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime

from gateway.streams import VERIFY_S, StreamState, follow
from services.bus.events import Events, JobEvent, JobFeed, position
from services.db.records import RESUMED, SUSPENDED, ImageRecord, JobRecord, JobState, SuspendEvent
from services.db.states import JobStatus
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

J = "job-1"
HOLDER = "sampler-w1"  # the publisher of worker w1, which holds the job's attempt
OTHER = "sampler-w2"


def held(attempt: int, status: JobStatus | None = None, **fields: object) -> JobEvent:
    """An event of ``attempt`` published by w1."""
    return JobEvent(J, attempt, status, publisher=HOLDER, **fields)  # type: ignore[arg-type]


def statuses(events: list[pb.JobEvent]) -> list[int]:
    return [e.status for e in events if e.HasField("status")]


def test_states_are_ordered_by_attempt_then_stage() -> None:
    life = [
        (0, JobStatus.QUEUED),
        (1, JobStatus.SCHEDULED),
        (1, JobStatus.RUNNING),
        (1, JobStatus.DECODING),
        (1, JobStatus.QUEUED),  # requeued: the same attempt, back in the queue
        (2, JobStatus.SCHEDULED),
        (2, JobStatus.RUNNING),
        (2, JobStatus.SUCCEEDED),
    ]
    assert [position(a, s) for a, s in life] == sorted(position(a, s) for a, s in life)


def test_a_stream_sends_each_status_once_in_order_whatever_order_events_come_in() -> None:
    state = StreamState(J)
    sent = [state.on_stored(JobStatus.QUEUED, 0)]
    # The worker's RUNNING overtook the scheduler's SCHEDULED (two publishers). Its
    # worker is not known yet: the read it makes (``follow``) tells it.
    assert not state.trusts(held(1, JobStatus.RUNNING))
    sent.append(state.on_stored(JobStatus.RUNNING, 1, "w1"))
    sent += state.on_event(held(1, JobStatus.RUNNING))  # a repeat: dropped
    sent += state.on_event(JobEvent(J, 1, JobStatus.SCHEDULED, publisher="scheduler"))  # stale: dropped
    sent += state.on_event(held(1, JobStatus.DECODING))
    sent.append(state.on_stored(JobStatus.DECODING, 1, "w1"))  # read after a silence: nothing new
    sent += state.on_event(held(1, JobStatus.SUCCEEDED))
    assert statuses([e for e in sent if e is not None]) == [
        pb.JOB_STATUS_QUEUED,
        pb.JOB_STATUS_RUNNING,
        pb.JOB_STATUS_DECODING,
        pb.JOB_STATUS_SUCCEEDED,
    ]
    assert state.ended


def test_progress_is_sent_once_per_step_for_the_running_attempt_only() -> None:
    state = StreamState(J)
    state.on_stored(JobStatus.RUNNING, 1, "w1")
    sent = state.on_event(held(1, step=1, total=4))
    sent += state.on_event(held(1, step=1, total=4))  # twice: once
    sent += state.on_event(held(1, step=3, total=4))
    sent += state.on_event(held(1, step=2, total=4))  # late: behind what was sent
    assert [(e.progress.step, e.progress.total) for e in sent] == [(1, 4), (3, 4)]
    # The attempt fails and is retried: the old attempt's steps say nothing now.
    state.on_event(held(1, JobStatus.QUEUED))
    assert state.on_event(held(1, step=4, total=4)) == []
    # The next attempt's progress starts over.
    state.on_stored(JobStatus.RUNNING, 2, "w1")
    [again] = state.on_event(held(2, step=1, total=4))
    assert again.progress.step == 1


def test_a_step_done_says_its_attempt_is_running_when_that_event_was_lost() -> None:
    state = StreamState(J)
    state.on_stored(JobStatus.SCHEDULED, 1, "w1")
    running, step = state.on_event(held(1, step=1, total=2))
    assert running.status == pb.JOB_STATUS_RUNNING
    assert (step.progress.step, step.progress.total) == (1, 2)


def test_a_change_without_a_status_is_left_to_the_database() -> None:
    state = StreamState(J)
    state.on_stored(JobStatus.RUNNING, 1)
    assert state.on_event(JobEvent(J, 0)) == []  # e.g. requeued by recovery: the caller reads the job
    assert not state.ended


def test_suspensions_and_resumptions_are_sent_once_each_in_order() -> None:
    at = datetime(2026, 11, 22, tzinfo=UTC)
    suspended = SuspendEvent(SUSPENDED, 1, "w1", 7, 20, at, "drain")
    resumed = SuspendEvent(RESUMED, 2, "w2", 7, 20, at)
    state = StreamState(J)
    assert state.on_log(()) == []
    [first] = state.on_log((suspended,))
    assert first.WhichOneof("event") == "suspended"
    assert (first.suspended.attempt, first.suspended.worker_id, first.suspended.step) == (1, "w1", 7)
    assert first.suspended.reason == "drain"
    # Read again after a silence, and once more after it resumed: only what is new.
    assert state.on_log((suspended,)) == []
    [second] = state.on_log((suspended, resumed))
    assert second.WhichOneof("event") == "resumed"
    assert (second.resumed.attempt, second.resumed.worker_id, second.resumed.step) == (2, "w2", 7)
    assert state.on_log((suspended, resumed)) == []


PREVIEW = b"\xff\xd8 a jpeg"


def previewed(event: JobEvent) -> JobEvent:
    """``event``'s step with a preview of its first image."""
    return replace(event, preview=PREVIEW, index=0, size=(8, 8))


def forgeries(publisher: str, attempt: int) -> list[JobEvent]:
    """What a publisher that does not hold the job might say of it."""
    return [
        JobEvent(J, attempt, step=98, total=99, publisher=publisher),
        previewed(JobEvent(J, attempt, step=98, total=99, publisher=publisher)),
        JobEvent(J, attempt, JobStatus.FAILED, publisher=publisher),
        JobEvent(J, attempt + 1, JobStatus.RUNNING, publisher=publisher),
        JobEvent(J, attempt + 1, step=98, total=99, publisher=publisher),
        JobEvent(J, 0, publisher=publisher),  # a change to read
    ]


def test_only_the_holder_of_the_attempt_and_the_control_plane_are_told() -> None:
    state = StreamState(J)
    state.on_stored(JobStatus.RUNNING, 1, "w1")
    # Another sampler, a subject that names no publisher, a name that merely begins alike.
    for publisher in (OTHER, "", "sampler-w1x", "w1"):
        for event in forgeries(publisher, 1):
            assert not state.trusts(event) and state.on_event(event) == [], event
    # The holder, of an attempt that is not the job's: not told either.
    assert state.on_event(held(2, step=1, total=10)) == []
    assert state.on_event(held(2, JobStatus.FAILED)) == []
    # Its own steps and previews are.
    [step] = state.on_event(held(1, step=2, total=10))
    [preview] = state.on_event(previewed(held(1, step=2, total=10)))
    assert (step.progress.step, preview.preview.data) == (2, PREVIEW)
    # So is the control plane: a gateway's cancel.
    [cancelled] = state.on_event(JobEvent(J, 1, JobStatus.CANCELLED, publisher="gateway"))
    assert cancelled.status == pb.JOB_STATUS_CANCELLED and state.ended
    # A job no worker holds (requeued): no sampler is told, not even its last.
    state = StreamState(J)
    state.on_stored(JobStatus.QUEUED, 1)
    assert not state.trusts(held(1, step=3, total=10)) and not state.trusts(held(2, JobStatus.RUNNING))


class Heard(Events):
    """Job events the test hands the streams that follow them."""

    def __init__(self) -> None:
        super().__init__(None)

    def follow(self, job_id: str) -> JobFeed:
        return JobFeed(job_id, self._followers)

    def hear(self, *events: JobEvent) -> None:
        for event in events:
            for feed in self._followers.get(event.job_id, []):
                feed.put(event)


class Stored:
    """The job's record, and how often a stream read it."""

    def __init__(self, state: JobState) -> None:
        self.state = state
        self.reads = 0
        self.was_read = asyncio.Event()

    async def read(self, job_id: str) -> JobState:
        self.reads += 1
        self.was_read.set()
        return self.state


async def never_ends(job_id: str) -> tuple[JobRecord, list[ImageRecord]]:
    raise AssertionError("the job does not end in this test")


async def next_told(stream: AsyncIterator[pb.JobEvent]) -> pb.JobEvent:
    return await asyncio.wait_for(anext(stream), 2 * VERIFY_S)


async def test_a_stream_reads_its_job_to_learn_the_next_attempts_worker_then_tells_its_events() -> None:
    heard, stored = Heard(), Stored(JobState(JobStatus.QUEUED, 0))
    stream = follow(J, heard, stored.read, never_ends)
    assert (await next_told(stream)).status == pb.JOB_STATUS_QUEUED
    # Placed on w1, which runs it: its first events make the stream read the job once.
    stored.state = JobState(JobStatus.RUNNING, 1, worker_id="w1")
    heard.hear(held(1, JobStatus.RUNNING), held(1, step=1, total=4))
    running, step = await next_told(stream), await next_told(stream)
    assert (running.status, step.progress.step) == (pb.JOB_STATUS_RUNNING, 1)
    heard.hear(held(1, step=2, total=4))
    assert (await next_told(stream)).progress.step == 2
    assert stored.reads == 2
    # Requeued and placed on w2: w1's late step is not told, w2's are, once read.
    stored.state = replace(stored.state, attempt=2, worker_id="w2")
    placed = JobEvent(J, 2, JobStatus.SCHEDULED, publisher="scheduler")
    heard.hear(placed, held(1, step=3, total=4), JobEvent(J, 2, step=1, total=4, publisher=OTHER))
    told = [await next_told(stream) for _ in range(3)]
    assert [e.status for e in told[:2]] == [pb.JOB_STATUS_SCHEDULED, pb.JOB_STATUS_RUNNING]
    assert told[2].progress == pb.Progress(step=1, total=4)
    assert stored.reads == 3
    await stream.aclose()  # type: ignore[attr-defined]


async def test_a_placement_naming_its_worker_lets_the_stream_tell_that_workers_events_without_a_read() -> None:
    heard, stored = Heard(), Stored(JobState(JobStatus.QUEUED, 0))
    stream = follow(J, heard, stored.read, never_ends)
    assert (await next_told(stream)).status == pb.JOB_STATUS_QUEUED
    placed = JobEvent(J, 1, JobStatus.SCHEDULED, worker="w1", publisher="scheduler")
    heard.hear(placed, held(1, JobStatus.RUNNING), held(1, step=1, total=4))
    told = [await next_told(stream) for _ in range(3)]
    assert [e.status for e in told[:2]] == [pb.JOB_STATUS_SCHEDULED, pb.JOB_STATUS_RUNNING]
    assert told[2].progress == pb.Progress(step=1, total=4)
    assert stored.reads == 1  # the one as it opened: w1 was vouched for by its placement
    await stream.aclose()  # type: ignore[attr-defined]


def test_a_stale_placement_or_a_samplers_claim_does_not_move_the_holder() -> None:
    state = StreamState(J)
    state.on_stored(JobStatus.RUNNING, 2, "w1")
    state.on_event(JobEvent(J, 1, JobStatus.SCHEDULED, worker="w2", publisher="scheduler"))
    state.on_event(JobEvent(J, 3, JobStatus.SCHEDULED, worker="w2", publisher=HOLDER))
    assert state.trusts(held(2, step=1, total=4))
    assert not state.trusts(JobEvent(J, 2, step=1, total=4, publisher=OTHER))


async def test_another_samplers_events_are_never_told_and_cost_at_most_a_read_per_verify_interval() -> None:
    heard, stored = Heard(), Stored(JobState(JobStatus.RUNNING, 1, worker_id="w1"))
    stream = follow(J, heard, stored.read, never_ends)
    told = [await next_told(stream)]

    async def collect() -> None:
        async for event in stream:
            told.append(event)

    collecting = asyncio.create_task(collect())
    loop = asyncio.get_running_loop()
    began, steps = loop.time(), 0
    while loop.time() - began < 4 * VERIFY_S:
        heard.hear(*forgeries(OTHER, 1), *forgeries("", 1), *forgeries(OTHER, 7))
        if loop.time() - began > steps * 0.05:
            steps += 1
            heard.hear(held(1, step=steps, total=1000), previewed(held(1, step=steps, total=1000)))
        await asyncio.sleep(0.002)
    await asyncio.sleep(0.05)
    collecting.cancel()
    assert [e.status for e in told if e.HasField("status")] == [pb.JOB_STATUS_RUNNING]
    assert [e.progress.step for e in told if e.HasField("progress")] == list(range(1, steps + 1))
    assert [e.preview.step for e in told if e.HasField("preview")] == list(range(1, steps + 1))
    assert all(e.progress.total == 1000 for e in told if e.HasField("progress"))
    # Thousands of forgeries: a read when the stream opened, then one per VERIFY_S at most.
    assert 2 <= stored.reads <= 1 + 4 + 1, stored.reads


async def test_a_new_holders_steps_that_wait_for_the_read_are_all_told_in_order() -> None:
    """A drain: the old holder's late event makes the stream read the job; the next
    attempt's worker starts within VERIFY_S of that read, and every one of its steps
    heard before the next read is told after it, in order (only the latest was)."""
    heard, stored = Heard(), Stored(JobState(JobStatus.RUNNING, 1, worker_id="w1"))
    stream = follow(J, heard, stored.read, never_ends)
    assert (await next_told(stream)).status == pb.JOB_STATUS_RUNNING
    # Suspended at step 5: queued again, no worker holds it; w1 says so.
    stored.state = JobState(JobStatus.QUEUED, 1)
    heard.hear(held(1))
    assert (await next_told(stream)).status == pb.JOB_STATUS_QUEUED
    told: list[pb.JobEvent] = []

    async def collect() -> None:
        async for event in stream:
            told.append(event)

    collecting = asyncio.create_task(collect())
    # A late step of w1's, which the stream reads the job to check (and drops).
    stored.was_read.clear()
    heard.hear(held(1, step=5, total=10))
    await asyncio.wait_for(stored.was_read.wait(), 2 * VERIFY_S)
    # Resumed on w2 at once: its start and its steps come before the stream may read again.
    stored.state = JobState(JobStatus.RUNNING, 2, worker_id="w2")
    heard.hear(
        JobEvent(J, 2, JobStatus.RUNNING, publisher=OTHER),
        *(JobEvent(J, 2, step=s, total=10, publisher=OTHER) for s in (6, 7, 8)),
    )
    await asyncio.sleep(2 * VERIFY_S)
    collecting.cancel()
    assert statuses(told) == [pb.JOB_STATUS_RUNNING]
    assert [e.progress.step for e in told if e.HasField("progress")] == [6, 7, 8]
