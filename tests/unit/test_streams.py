"""What a StreamJob stream tells its client, from the job as stored and the events
heard on NATS in any order: each status once, in the order the job went through
them, progress only for the attempt that runs."""

from __future__ import annotations

from datetime import UTC, datetime

from gateway.streams import StreamState
from services.bus.events import JobEvent, position
from services.db.records import RESUMED, SUSPENDED, SuspendEvent
from services.db.states import JobStatus
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

J = "job-1"


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
    # The worker's RUNNING overtook the scheduler's SCHEDULED (two publishers).
    sent += state.on_event(JobEvent(J, 1, JobStatus.RUNNING))
    sent += state.on_event(JobEvent(J, 1, JobStatus.SCHEDULED))  # stale: dropped
    sent += state.on_event(JobEvent(J, 1, JobStatus.RUNNING))  # a repeat: dropped
    sent += state.on_event(JobEvent(J, 1, JobStatus.DECODING))
    sent.append(state.on_stored(JobStatus.DECODING, 1))  # read after a silence: nothing new
    sent += state.on_event(JobEvent(J, 1, JobStatus.SUCCEEDED))
    assert statuses([e for e in sent if e is not None]) == [
        pb.JOB_STATUS_QUEUED,
        pb.JOB_STATUS_RUNNING,
        pb.JOB_STATUS_DECODING,
        pb.JOB_STATUS_SUCCEEDED,
    ]
    assert state.ended


def test_progress_is_sent_once_per_step_for_the_running_attempt_only() -> None:
    state = StreamState(J)
    state.on_stored(JobStatus.RUNNING, 1)
    sent = state.on_event(JobEvent(J, 1, step=1, total=4))
    sent += state.on_event(JobEvent(J, 1, step=1, total=4))  # twice: once
    sent += state.on_event(JobEvent(J, 1, step=3, total=4))
    sent += state.on_event(JobEvent(J, 1, step=2, total=4))  # late: behind what was sent
    assert [(e.progress.step, e.progress.total) for e in sent] == [(1, 4), (3, 4)]
    # The attempt fails and is retried: the old attempt's steps say nothing now.
    state.on_event(JobEvent(J, 1, JobStatus.QUEUED))
    assert state.on_event(JobEvent(J, 1, step=4, total=4)) == []
    # The next attempt's progress starts over.
    state.on_event(JobEvent(J, 2, JobStatus.RUNNING))
    [again] = state.on_event(JobEvent(J, 2, step=1, total=4))
    assert again.progress.step == 1


def test_a_step_done_says_its_attempt_is_running_when_that_event_was_lost() -> None:
    state = StreamState(J)
    state.on_stored(JobStatus.SCHEDULED, 1)
    running, step = state.on_event(JobEvent(J, 1, step=1, total=2))
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
