"""Checkpoints and suspensions against a real PostgreSQL: only the attempt now
current on its worker stores a checkpoint, a later one is never replaced by an
earlier one, a resumed attempt reads only the checkpoint its job row names, and a
suspension puts the job back in the queue without costing an attempt."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import psycopg
import pytest

from services.db.records import RESUMED, SUSPENDED, Assignment, ImageRecord, JobSummary
from services.db.repository import Repository, Result, Standing, StartRequest, StepReport
from services.db.states import JobStatus, WorkerKind
from services.db.tenant_records import DEFAULT_TENANT
from services.db.worker_records import WorkerHeartbeat
from services.ops.embedded import EmbeddedPostgres
from tests.conftest import migrated_database
from tests.records import new_job

pytestmark = [pytest.mark.integration, pytest.mark.quick]

W1, W2 = "host-cpu0", "host-cpu1"


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
async def repo(postgres: EmbeddedPostgres) -> AsyncIterator[Repository]:
    url = migrated_database(postgres)
    r = Repository(url, pool_size=2)
    for worker in (W1, W2):
        heartbeat = WorkerHeartbeat(worker, WorkerKind.SAMPLER, f"{worker}:1", "cpu", ("tiny",), ("tiny",))
        await r.workers.register(heartbeat, str(uuid.uuid4()))
    try:
        yield r
    finally:
        await r.close()


async def running(repo: Repository, worker_id: str, job_id: str | None = None) -> tuple[str, int]:
    """A job placed on ``worker_id`` and started there; (job id, attempt)."""
    if job_id is None:
        job_id = str(uuid.uuid4())
        await repo.jobs.create(new_job(id=job_id, steps=20), now=now())
    async with repo.scheduling.placement_pass(limit=100, max_attempts=3, now=now()) as read:
        assert read is not None
        seen: list[JobSummary] = list(read.queued)
        placed = await read.assign([Assignment(j.id, worker_id, {}) for j in read.queued if j.id == job_id])
    assert [j.id for j in placed] == [job_id]
    # As the pass read it (JSON): every timestamp a datetime again.
    [summary] = [j for j in seen if j.id == job_id]
    assert isinstance(summary.created_at, datetime)
    assert summary.aged_from is None or isinstance(summary.aged_from, datetime)
    attempt = placed[0].attempt
    assert await repo.attempts.start(job_id, attempt, worker_id, now=now()) is not None
    return job_id, attempt


async def save(repo: Repository, job_id: str, attempt: int, worker_id: str, step: int) -> bool:
    data = f"state at {step}".encode()
    return await repo.checkpoints.save(job_id, attempt, worker_id, step=step, total=20, data=data, now=now())


async def test_only_the_current_attempt_stores_and_an_earlier_step_never_replaces_a_later(repo: Repository) -> None:
    job_id, attempt = await running(repo, W1)
    assert await save(repo, job_id, attempt, W1, 9)
    # Periodic writes may land out of order: the step-6 one arriving late is refused.
    assert not await save(repo, job_id, attempt, W1, 6)
    # Another worker, or an attempt that is not the job's current one, stores nothing.
    assert not await save(repo, job_id, attempt, W2, 12)
    assert not await save(repo, job_id, attempt - 1, W1, 12)
    job = await repo.jobs.get(job_id)
    assert (job.checkpoint_step, job.checkpoint_attempt) == (9, attempt)
    [stored] = (await repo.checkpoints.load([job])).values()
    assert (stored.attempt, stored.step, stored.data) == (attempt, 9, b"state at 9")


async def test_a_crashed_attempt_is_resumed_from_its_checkpoint_and_its_late_writes_are_refused(
    repo: Repository,
) -> None:
    job_id, first = await running(repo, W1)
    assert await save(repo, job_id, first, W1, 8)
    # W1 restarts: what it held goes back to the queue, a failure counted.
    await repo.workers.register(
        WorkerHeartbeat(W1, WorkerKind.SAMPLER, f"{W1}:1", "cpu", ("tiny",), ("tiny",)), str(uuid.uuid4())
    )
    queued = await repo.jobs.get(job_id)
    assert queued.status == JobStatus.QUEUED and queued.failures == 1
    assert (queued.checkpoint_step, queued.progress_step) == (8, 8)

    _, second = await running(repo, W2, job_id)
    resumed = await repo.jobs.get(job_id)
    assert resumed.progress_step == 8  # progress continues from the checkpoint
    [entry] = resumed.resumptions
    assert (entry.kind, entry.attempt, entry.worker_id, entry.step) == (RESUMED, second, W2, 8)
    [stored] = (await repo.checkpoints.load([resumed])).values()
    assert (stored.attempt, stored.step) == (first, 8)
    # The first attempt, still alive somewhere, cannot overwrite the state the
    # second one resumes from or goes on to write.
    assert not await save(repo, job_id, first, W1, 15)
    assert await save(repo, job_id, second, W2, 12)
    job = await repo.jobs.get(job_id)
    assert (job.checkpoint_step, job.checkpoint_attempt) == (12, second)


async def test_a_checkpoint_the_job_row_does_not_name_is_never_loaded(repo: Repository) -> None:
    job_id, attempt = await running(repo, W1)
    assert await save(repo, job_id, attempt, W1, 5)
    # A checkpoint row that does not match what the job row names (a stale write
    # from a time before fencing, a restore from backup) is ignored.
    async with await psycopg.AsyncConnection.connect(repo.db.url, autocommit=True) as conn:
        await conn.execute("UPDATE job_checkpoints SET attempt = attempt - 1 WHERE job_id = %s", (job_id,))
    assert await repo.checkpoints.load([await repo.jobs.get(job_id)]) == {}


async def test_suspension_requeues_without_an_attempt_and_logs_where_and_why(repo: Repository) -> None:
    job_id, attempt = await running(repo, W1)
    asked = await repo.checkpoints.request_suspend(job_id, attempt, max_preemptions=1, reason="preempted for j2")
    assert asked == f"{W1}:1"
    # Asked once: a second request finds it being suspended already.
    assert await repo.checkpoints.request_suspend(job_id, attempt, max_preemptions=1) is None
    reports = [StepReport(job_id, attempt, 3, 20)]
    assert await repo.attempts.progress_many(reports, W1) == {job_id: Standing.SUSPEND_REQUESTED}
    # A worker that learns of it from the flag, before the scheduler's call, knows why.
    assert await repo.checkpoints.suspend_reasons([job_id, "other"]) == {job_id: "preempted for j2"}
    status = await repo.checkpoints.suspend(
        job_id, attempt, W1, step=7, total=20, data=b"s7", reason="preempted for j2", preempted=True, now=now()
    )
    assert status == JobStatus.QUEUED
    job = await repo.jobs.get(job_id)
    assert job.status == JobStatus.QUEUED and job.failures == 0 and not job.attempt_log
    assert (job.checkpoint_step, job.progress_step, job.preemptions) == (7, 7, 1)
    assert not job.suspend_requested
    # Its priority ages anew, or it would outrank the job it made room for.
    assert job.aged_from is not None and job.aged_from > job.created_at
    [entry] = job.suspensions
    assert (entry.kind, entry.attempt, entry.worker_id, entry.step, entry.reason) == (
        SUSPENDED,
        attempt,
        W1,
        7,
        "preempted for j2",
    )
    # Preempted as often as allowed: the scheduler may not ask again.
    _, second = await running(repo, W2, job_id)
    assert (await repo.jobs.get(job_id)).aged_from == job.aged_from
    assert await repo.checkpoints.request_suspend(job_id, second, max_preemptions=1) is None
    # The stale attempt's suspension changes nothing.
    stale = await repo.checkpoints.suspend(
        job_id, attempt, W1, step=9, total=20, data=b"s9", reason="drain", preempted=False, now=now()
    )
    assert stale is None
    assert (await repo.jobs.get(job_id)).checkpoint_step == 7


async def test_the_checkpoints_of_ended_jobs_are_pruned_and_only_those(repo: Repository) -> None:
    succeeded, attempt = await running(repo, W1)
    assert await save(repo, succeeded, attempt, W1, 4)
    await repo.attempts.decoding([(succeeded, attempt)], W1, now=now())
    image = ImageRecord(0, b"png", "image/png", 64, 64, 1)
    assert await repo.attempts.finish_many([Result(succeeded, attempt, [image], now(), busy_s=1.0)], W1) == {succeeded}
    failed, failed_attempt = await running(repo, W1)
    assert await save(repo, failed, failed_attempt, W1, 4)
    await repo.attempts.fail(failed, failed_attempt, W1, "bad prompt", retryable=False, now=now())
    # Suspended, then cancelled while it waited in the queue.
    cancelled, cancelled_attempt = await running(repo, W1)
    await repo.checkpoints.suspend(
        cancelled, cancelled_attempt, W1, step=4, total=20, data=b"s4", reason="drain", preempted=False, now=now()
    )
    await repo.jobs.request_cancel(cancelled, tenant=DEFAULT_TENANT, now=now())
    alive, alive_attempt = await running(repo, W2)
    assert await save(repo, alive, alive_attempt, W2, 4)

    assert await repo.checkpoints.prune() == 3
    async with await psycopg.AsyncConnection.connect(repo.db.url, autocommit=True) as conn:
        rows = await (await conn.execute("SELECT job_id FROM job_checkpoints")).fetchall()
    assert rows == [(alive,)]


async def test_start_many_resumes_once_however_often_a_dispatch_is_redelivered(repo: Repository) -> None:
    job_id, attempt = await running(repo, W1)
    assert await save(repo, job_id, attempt, W1, 6)
    await repo.attempts.hand_back(job_id, attempt, W1, now=now())
    _, second = await running(repo, W2, job_id)
    again = await repo.attempts.start_many([StartRequest(job_id, second)], W2, now=now())
    assert again[job_id].progress_step == 6
    assert len((await repo.jobs.get(job_id)).resumptions) == 1
