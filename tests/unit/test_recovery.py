"""The recovery policy, over plain records and a fixed clock."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from scheduler.recovery import TIMEOUT_GRACE_S, Expire, Fail, Recovery, RecoveryConfig, Requeue
from scheduler.recovery import review as review_snapshot
from scheduler.snapshot import FleetSnapshot
from services.db.records import AttemptFailure, JobRecord
from services.db.states import JobStatus
from services.db.worker_records import DeadWorker
from tests.records import new_job, record

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
CONFIG = RecoveryConfig(max_attempts=3, timeouts={"tiny": 60.0})


def job(status: JobStatus = JobStatus.RUNNING, **changes) -> JobRecord:
    held = status in (JobStatus.SCHEDULED, JobStatus.RUNNING, JobStatus.DECODING)
    fields = {
        "status": status,
        "attempt": 1,
        "worker_id": "w1" if held else None,
        "progress_total": 10,
        "created_at": NOW - timedelta(seconds=30),
        "scheduled_at": NOW - timedelta(seconds=20),
        "started_at": NOW - timedelta(seconds=10),
    }
    return record(new_job(id="j1", prompt="p", seed=1, steps=10), **(fields | changes))


DEAD = [DeadWorker("w1", "no heartbeat for 12s")]


def review(jobs: list[JobRecord], dead: list[DeadWorker], now: datetime, config: RecoveryConfig) -> list[Recovery]:
    """The policy over a snapshot of ``jobs`` and ``dead`` at ``now``."""
    return review_snapshot(FleetSnapshot(now.timestamp(), stalled=tuple(jobs), dead=tuple(dead)), config)


def test_started_job_on_a_dead_worker_is_requeued_with_the_failure_counted() -> None:
    [action] = review([job()], DEAD, NOW, CONFIG)
    assert action == Requeue("j1", 1, JobStatus.RUNNING, AttemptFailure(1, "w1", "no heartbeat for 12s"))


def test_decoding_counts_as_started() -> None:
    [action] = review([job(JobStatus.DECODING)], DEAD, NOW, CONFIG)
    assert isinstance(action, Requeue) and action.failure is not None


def test_scheduled_job_on_a_dead_worker_costs_no_attempt() -> None:
    [action] = review([job(JobStatus.SCHEDULED, started_at=None)], DEAD, NOW, CONFIG)
    assert action == Requeue("j1", 1, JobStatus.SCHEDULED, None)


def test_job_on_a_live_worker_is_left_alone() -> None:
    assert review([job()], [DeadWorker("w2", "gone")], NOW, CONFIG) == []


def test_last_attempt_fails_the_job_naming_every_attempt() -> None:
    earlier = (AttemptFailure(1, "w0", "the worker restarted"), AttemptFailure(2, "w2", "CUDA error"))
    [action] = review([job(attempt=3, failures=2, attempt_log=earlier)], DEAD, NOW, CONFIG)
    assert isinstance(action, Fail)
    assert action.reason == (
        "failed after 3 attempts: attempt 1 on w0: the worker restarted; attempt 2 on w2: CUDA error;"
        " attempt 3 on w1: no heartbeat for 12s"
    )
    assert action.failure == AttemptFailure(3, "w1", "no heartbeat for 12s")


def test_queued_job_out_of_attempts_fails() -> None:
    log = tuple(AttemptFailure(i, "w1", "boom") for i in (1, 2, 3))
    [action] = review([job(JobStatus.QUEUED, failures=3, attempt_log=log, attempt=3)], [], NOW, CONFIG)
    assert isinstance(action, Fail) and action.reason.startswith("failed after 3 attempts: attempt 1 on w1: boom")


def test_queued_job_past_its_deadline_expires_even_with_attempts_left() -> None:
    queued = job(JobStatus.QUEUED, deadline=NOW - timedelta(seconds=1), attempt=0)
    assert review([queued], [], NOW, CONFIG) == [Expire("j1", 0)]
    assert review([replace(queued, deadline=NOW + timedelta(seconds=1))], [], NOW, CONFIG) == []


def test_running_past_the_timeout_and_its_grace_fails_the_attempt() -> None:
    limit = timedelta(seconds=60 + TIMEOUT_GRACE_S)
    assert review([job(started_at=NOW - limit + timedelta(seconds=1))], [], NOW, CONFIG) == []
    [action] = review([job(started_at=NOW - limit)], [], NOW, CONFIG)
    assert action == Requeue(
        "j1", 1, JobStatus.RUNNING, AttemptFailure(1, "w1", "ran past the 60s timeout"), cause="timed out"
    )


def test_cancel_requested_job_on_a_dead_worker_is_not_run_again() -> None:
    # Requeueing a job whose cancel was requested ends it CANCELLED; no attempt counts.
    [action] = review([job(cancel_requested=True)], DEAD, NOW, CONFIG)
    assert action == Requeue("j1", 1, JobStatus.RUNNING, None)


def test_unknown_model_uses_the_default_timeout() -> None:
    assert CONFIG.timeout_s("other") == 600.0
    assert CONFIG.shortest_timeout_s == 60.0 + TIMEOUT_GRACE_S
