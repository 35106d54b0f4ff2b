"""What a running job's progress write learns back stops it: a cancel, a
supersession, or the scheduler's suspend flag, which, heard before the scheduler's
call, still says whom the suspension makes room for."""

from __future__ import annotations

import asyncio
from typing import cast

from gpu_worker.jobs.job_store import JobStore
from gpu_worker.jobs.progress import BatchProgress, StepProgress
from gpu_worker.jobs.tracker import JobWatch, StopReason
from services.db.repository import Repository, Standing, StepReport
from tests.fakes import FakeRepository, RecordedEvents
from tests.records import record


async def stopped_by(standing: Standing, asked: dict[str, str]) -> JobWatch:
    repo = FakeRepository()
    repo.attempts.standing = standing
    repo.checkpoints.suspend_asked = asked
    events = RecordedEvents()
    progress = BatchProgress(
        JobStore(cast(Repository, repo), events, "w1", outcome_retry_s=5.0), events, asyncio.get_running_loop()
    )
    job = record(id="j1", attempt=1)
    watch = JobWatch(job.id, job.attempt)
    await progress._report([], [(StepProgress(progress, job, watch), StepReport(job.id, job.attempt, 3, 20))])
    return watch


async def test_a_suspension_heard_from_its_flag_says_whom_it_makes_room_for() -> None:
    watch = await stopped_by(Standing.SUSPEND_REQUESTED, {"j1": "preempted for j2"})
    assert (watch.stop_reason, watch.detail) == (StopReason.PREEMPTED, "preempted for j2")


async def test_a_flag_without_a_stored_reason_still_suspends() -> None:
    # Set by a scheduler from before the reason was stored.
    watch = await stopped_by(Standing.SUSPEND_REQUESTED, {"j1": ""})
    assert (watch.stop_reason, watch.detail) == (StopReason.PREEMPTED, "preempted for waiting work")


async def test_a_cancel_stops_it_and_no_reason_is_read() -> None:
    watch = await stopped_by(Standing.CANCEL_REQUESTED, {"j1": "preempted for j2"})
    assert (watch.stop_reason, watch.detail) == (StopReason.CANCELLED, "")
