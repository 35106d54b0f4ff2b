"""The repository against a real PostgreSQL: writes from an older attempt change
nothing, a new incarnation takes back what the old one held, and the recovery
pass applies the policy's decisions under the scheduler lock."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from scheduler.passes import learn_run_times
from scheduler.recovery import Recovery, RecoveryConfig
from scheduler.stalled import recover_stalled
from services.db.records import Assignment, ImageRecord, JobSummary
from services.db.repository import Repository, Standing, StepReport
from services.db.repository.scheduling import PlacementPass
from services.db.states import JobStatus, WorkerKind, WorkerStatus
from services.db.worker_records import WorkerHeartbeat
from services.errors import WorkerIdTaken
from services.generation import JobInputs, Prompts
from tests.records import new_job

pytestmark = [pytest.mark.integration, pytest.mark.quick]

W1, W2 = "host-cpu0", "host-cpu1"
IMAGE = ImageRecord(0, b"png", "image/png", 64, 64, 1)


def now() -> datetime:
    return datetime.now(UTC)


def heartbeat(worker_id: str) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id, WorkerKind.SAMPLER, "127.0.0.1:1", "cpu", ("tiny",), ("tiny",))


async def submit(repo: Repository, **changes) -> str:
    job = new_job(id=str(uuid.uuid4()), prompt="p", seed=1, **changes)
    await repo.jobs.create(job, now=now())
    return job.id


async def placement_pass(
    repo: Repository, assign: Callable[[PlacementPass], list[Assignment]], *, limit: int = 100
) -> list[JobSummary] | None:
    """A real placement pass, assigning what ``assign`` says of what it read."""
    async with repo.scheduling.placement_pass(limit=limit, max_attempts=3, now=now()) as read:
        return None if read is None else await read.assign(assign(read))


async def schedule(repo: Repository, job_id: str, worker_id: str) -> int:
    """Places the job on ``worker_id`` through a real placement pass; returns its attempt."""
    placed = await placement_pass(
        repo, lambda read: [Assignment(j.id, worker_id, {}) for j in read.queued if j.id == job_id]
    )
    assert placed is not None and [j.id for j in placed] == [job_id]
    return placed[0].attempt


async def requeue_everything_of(repo: Repository, worker_id: str) -> None:
    await repo.workers.register(heartbeat(worker_id), str(uuid.uuid4()))


@pytest.fixture
async def workers(repo: Repository) -> dict[str, str]:
    incarnations = {w: str(uuid.uuid4()) for w in (W1, W2)}
    for w, inc in incarnations.items():
        await repo.workers.register(heartbeat(w), inc)
    return incarnations


async def test_every_write_of_an_older_attempt_changes_nothing(repo: Repository, workers) -> None:
    job_id = await submit(repo)
    old = await schedule(repo, job_id, W1)
    assert await repo.attempts.start(job_id, old, W1, now=now()) is not None
    # W1 restarts: a new incarnation takes the job back; then it runs on W2.
    await requeue_everything_of(repo, W1)
    new = await schedule(repo, job_id, W2)
    assert new == old + 1
    assert await repo.attempts.start(job_id, new, W2, now=now()) is not None
    assert await repo.attempts.progress_many([StepReport(job_id, new, 2, 4)], W2) == {job_id: Standing.CURRENT}

    assert await repo.attempts.start(job_id, old, W1, now=now()) is None
    assert await repo.attempts.progress_many([StepReport(job_id, old, 4, 4)], W1) == {job_id: Standing.SUPERSEDED}
    assert not await repo.attempts.decoding([(job_id, old)], W1, now=now())
    assert not await repo.attempts.finish(job_id, old, W1, [IMAGE], now=now(), busy_s=1.0)
    assert await repo.attempts.fail(job_id, old, W1, "late", retryable=True, now=now()) is None
    assert await repo.attempts.fail(job_id, old, W1, "late", retryable=False, now=now()) is None
    assert not await repo.attempts.cancel(job_id, old, W1, now=now())
    assert not await repo.attempts.hand_back(job_id, old, W1, now=now())
    # The same attempt from the wrong worker is as stale.
    assert not await repo.attempts.finish(job_id, new, W1, [IMAGE], now=now(), busy_s=1.0)

    job = await repo.jobs.get(job_id)
    assert (job.status, job.attempt, job.worker_id, job.progress_step) == (JobStatus.RUNNING, new, W2, 2)
    assert (await repo.jobs.get_with_images(job_id))[1] == []
    assert await repo.attempts.finish(job_id, new, W2, [IMAGE], now=now(), busy_s=1.0)
    assert not await repo.attempts.finish(job_id, new, W2, [IMAGE], now=now(), busy_s=1.0), "one result at most"
    assert len((await repo.jobs.get_with_images(job_id))[1]) == 1
    assert (await repo.jobs.get(job_id)).status == JobStatus.SUCCEEDED


async def test_a_placement_returns_the_prompts_its_samplers_encode(repo: Repository, workers) -> None:
    """As each job is sampled: an expanded prompt in its prompt's place; none for a
    job with an input image (a text encoder may see it)."""
    jobs = [
        new_job(id=str(uuid.uuid4()), prompt="a lighthouse", negative_prompt="fog"),
        new_job(id=str(uuid.uuid4()), prompt="a cat", expanded_prompt="a cat, oil painting"),
        new_job(id=str(uuid.uuid4()), prompt="make it red", image_digest="d" * 64, inputs=JobInputs(b"png")),
    ]
    for job in jobs:
        await repo.jobs.create(job, now=now())
    plain, expanded, edit = (job.id for job in jobs)
    async with repo.scheduling.placement_pass(limit=100, max_attempts=3, now=now()) as read:
        assert read is not None
        placed = await read.assign([Assignment(j.id, W1, {}) for j in read.queued])
        assert {j.id for j in placed} == {plain, expanded, edit}
        assert read.prompts == {plain: Prompts("a lighthouse", "fog"), expanded: Prompts("a cat, oil painting", "")}


async def test_a_batch_s_progress_is_one_write_that_tells_each_job_where_it_stands(repo: Repository, workers) -> None:
    running, cancelled, moved = await submit(repo), await submit(repo), await submit(repo)
    attempts = {job_id: await schedule(repo, job_id, W1) for job_id in (running, cancelled, moved)}
    for job_id, attempt in attempts.items():
        assert await repo.attempts.start(job_id, attempt, W1, now=now()) is not None
    job = await repo.jobs.get(cancelled)
    await repo.jobs.request_cancel(cancelled, tenant=job.tenant, now=now())
    reports = [StepReport(job_id, attempt, 3, 8) for job_id, attempt in attempts.items()]
    reports[2] = StepReport(moved, attempts[moved] - 1, 3, 8)  # an older attempt of it
    assert await repo.attempts.progress_many(reports, W1) == {
        running: Standing.CURRENT,
        cancelled: Standing.CANCEL_REQUESTED,
        moved: Standing.SUPERSEDED,
    }
    assert [(await repo.jobs.get(j)).progress_step for j in (running, cancelled, moved)] == [3, 3, 0]


async def test_a_job_started_on_the_gpu_when_its_batch_began_denoising(repo: Repository, workers) -> None:
    job_id = await submit(repo)
    attempt = await schedule(repo, job_id, W1)
    claimed = now()
    assert await repo.attempts.start(job_id, attempt, W1, now=claimed) is not None
    # Claimed while the batch before it finished; its own batch began a second later.
    began = claimed + timedelta(seconds=1)
    assert await repo.attempts.decoding([(job_id, attempt)], W1, now=began + timedelta(seconds=2), sampling_began=began)
    assert (await repo.jobs.get(job_id)).started_at == began
    # Never before it was claimed.
    other = await submit(repo)
    attempt = await schedule(repo, other, W1)
    await repo.attempts.start(other, attempt, W1, now=claimed)
    await repo.attempts.decoding([(other, attempt)], W1, now=began, sampling_began=claimed - timedelta(seconds=5))
    assert (await repo.jobs.get(other)).started_at == claimed


async def test_new_incarnation_requeues_what_the_old_one_held(repo: Repository, workers) -> None:
    started, waiting = await submit(repo), await submit(repo)
    a = await schedule(repo, started, W1)
    await schedule(repo, waiting, W1)
    await repo.attempts.start(started, a, W1, now=now())
    registration = await repo.workers.register(heartbeat(W1), str(uuid.uuid4()))
    assert sorted(registration.requeued) == sorted([started, waiting])
    s, w = await repo.jobs.get(started), await repo.jobs.get(waiting)
    assert (s.status, s.failures, [f.error for f in s.attempt_log]) == (JobStatus.QUEUED, 1, ["the worker restarted"])
    assert (w.status, w.failures, w.attempt_log) == (JobStatus.QUEUED, 0, ())
    # The same incarnation registering again takes nothing back.
    again = await schedule(repo, started, W2)
    assert (await repo.workers.register(heartbeat(W2), workers[W2])).requeued == ()
    assert (await repo.jobs.get(started)).attempt == again


async def test_a_worker_id_a_worker_of_the_other_kind_holds_is_refused_at_registration(
    repo: Repository, workers
) -> None:
    """A sampler and a decoder given the same id: the second to register is refused,
    and the first keeps its row and what it holds."""
    job_id = await submit(repo)
    attempt = await schedule(repo, job_id, W1)
    await repo.attempts.start(job_id, attempt, W1, now=now())
    decoder = replace(heartbeat(W1), kind=WorkerKind.DECODER, address="10.6.6.6:1")
    with pytest.raises(WorkerIdTaken, match=f"{W1}.*sampler"):
        await repo.workers.register(decoder, str(uuid.uuid4()))
    sampler = await repo.workers.get(W1)
    assert sampler is not None and (sampler.kind, sampler.address) == (WorkerKind.SAMPLER, "127.0.0.1:1")
    job = await repo.jobs.get(job_id)
    assert (job.status, job.attempt, job.worker_id) == (JobStatus.RUNNING, attempt, W1)


async def test_workers_gone_for_good_are_found_kind_by_kind(repo: Repository, workers) -> None:
    decoder = replace(heartbeat("host-decoder-0"), kind=WorkerKind.DECODER)
    await repo.workers.register(decoder, str(uuid.uuid4()))
    for worker_id in (W1, W2, decoder.id):
        age_registration(repo.db.url, worker_id, 120)
    # A decoder heard from under W2's id does not keep sampler W2 from being forgotten.
    assert await repo.workers.forgettable(WorkerKind.SAMPLER, gone_for_s=60, heard_from=[W1]) == [W2]
    assert await repo.workers.forgettable(WorkerKind.DECODER, gone_for_s=60, heard_from=[W2]) == [decoder.id]


async def test_deregister_hands_back_without_counting(repo: Repository, workers) -> None:
    job_id = await submit(repo)
    await schedule(repo, job_id, W1)
    assert await repo.workers.deregister(W1, workers[W1]) == [job_id]
    job = await repo.jobs.get(job_id)
    assert (job.status, job.failures, job.worker_id) == (JobStatus.QUEUED, 0, None)
    assert (await repo.workers.get(W1)).status == WorkerStatus.GONE  # type: ignore[union-attr]


async def test_retryable_failure_requeues_and_the_last_one_fails_with_every_reason(repo: Repository, workers) -> None:
    job_id = await submit(repo)
    for n in range(1, 4):
        attempt = await schedule(repo, job_id, W1)
        await repo.attempts.start(job_id, attempt, W1, now=now())
        assert await repo.attempts.fail(job_id, attempt, W1, f"boom {n}", retryable=True, now=now()) == JobStatus.QUEUED
    # Out of attempts: never placed again, and the recovery pass fails it.
    assert await placement_pass(repo, lambda read: [Assignment(j.id, W1, {}) for j in read.queued], limit=10) == []
    await recovery_pass(repo)
    job = await repo.jobs.get(job_id)
    assert job.status == JobStatus.FAILED
    assert (
        job.error
        == f"failed after 3 attempts: attempt 1 on {W1}: boom 1; attempt 2 on {W1}: boom 2; attempt 3 on {W1}: boom 3"
    )


async def test_non_retryable_failure_fails_at_once(repo: Repository, workers) -> None:
    job_id = await submit(repo)
    attempt = await schedule(repo, job_id, W1)
    await repo.attempts.start(job_id, attempt, W1, now=now())
    assert await repo.attempts.fail(job_id, attempt, W1, "bad input", retryable=False, now=now()) == JobStatus.FAILED


def age_registration(repo_url: str, worker_id: str, seconds: float) -> None:
    """As if the worker registered (or last heartbeat in the database) ``seconds`` ago."""
    with psycopg.connect(repo_url) as conn:
        conn.execute(
            "UPDATE workers SET last_heartbeat = now() - make_interval(secs => %s) WHERE id = %s", (seconds, worker_id)
        )


# Presence has just heard from both workers.
BOTH_HEARD = {W1: 0.5, W2: 0.5}


async def recovery_pass(
    repo: Repository, *, heard: dict[str, float] | None = BOTH_HEARD, stale_after_s: float = 60
) -> list[Recovery] | None:
    config = RecoveryConfig(max_attempts=3)
    return await recover_stalled(repo, config, stale_after_s=stale_after_s, heard=heard)


async def test_recovery_requeues_from_a_silent_worker_only_when_heartbeats_may_be_judged(
    repo: Repository, workers
) -> None:
    job_id = await submit(repo)
    attempt = await schedule(repo, job_id, W1)
    await repo.attempts.start(job_id, attempt, W1, now=now())
    silent = {W1: 30.0, W2: 0.5}  # presence last heard from W1 30 s ago
    # Just registered: the registry's own time keeps it alive.
    assert await recovery_pass(repo, heard=silent, stale_after_s=10) == []
    age_registration(repo.db.url, W1, 30)
    # Not yet to be judged (presence not settled), then heard lately: alive.
    assert await recovery_pass(repo, heard=None, stale_after_s=10) == []
    assert await recovery_pass(repo, heard={W1: 9.0, W2: 0.5}, stale_after_s=10) == []
    # Its NATS away, it heartbeat in the database instead: alive.
    await repo.workers.heartbeat(W1, workers[W1])
    assert await recovery_pass(repo, heard=silent, stale_after_s=10) == []
    assert (await repo.jobs.get(job_id)).status == JobStatus.RUNNING
    age_registration(repo.db.url, W1, 30)
    assert len(await recovery_pass(repo, heard=silent, stale_after_s=10) or []) == 1
    job = await repo.jobs.get(job_id)
    assert (job.status, job.failures) == (JobStatus.QUEUED, 1)
    assert job.attempt_log[0].error.startswith("no heartbeat for 3")
    # Its late result changes nothing.
    assert not await repo.attempts.finish(job_id, attempt, W1, [IMAGE], now=now(), busy_s=1.0)


async def test_recovery_expires_queued_jobs_past_their_deadline(repo: Repository, workers) -> None:
    late = await submit(repo, deadline=now() + timedelta(milliseconds=200))
    fine = await submit(repo, deadline=now() + timedelta(hours=1))
    await asyncio.sleep(0.3)
    # Not placed once past it, even before recovery runs.
    placed = await placement_pass(repo, lambda read: [Assignment(j.id, W1, {}) for j in read.queued], limit=10)
    assert [j.id for j in placed or []] == [fine]
    await recovery_pass(repo)
    assert (await repo.jobs.get(late)).status == JobStatus.EXPIRED
    assert (await repo.jobs.get(fine)).status == JobStatus.SCHEDULED
    assert (await repo.jobs.totals()).expired == 1


async def test_redelivered_dispatch_is_handled_idempotently(repo: Repository, workers) -> None:
    job_id = await submit(repo)
    attempt = await schedule(repo, job_id, W1)
    assert await repo.attempts.start(job_id, attempt, W1, now=now()) is not None
    # Its outcome could not be stored and the dispatch came back: the attempt starts over.
    again = await repo.attempts.start(job_id, attempt, W1, now=now())
    assert again is not None and again.status == JobStatus.RUNNING and again.starts == 2
    assert await repo.attempts.finish(job_id, attempt, W1, [IMAGE], now=now(), busy_s=1.0)
    # Redelivered once more after its outcome was stored (the ack was lost): nothing to run.
    assert await repo.attempts.start(job_id, attempt, W1, now=now()) is None
    assert len((await repo.jobs.get_with_images(job_id))[1]) == 1


async def test_run_times_are_learned_once_by_the_scheduler(repo: Repository, workers) -> None:
    from scheduler.costs import costs_from
    from services.models.registry import ModelRegistry

    costs = costs_from(ModelRegistry.load())
    timed, warm_up = await submit(repo), await submit(repo)
    for job_id, run_seconds in ((timed, 2.0), (warm_up, None)):
        attempt = await schedule(repo, job_id, W1)
        await repo.attempts.start(job_id, attempt, W1, now=now())
        await repo.attempts.finish(job_id, attempt, W1, [IMAGE], now=now(), busy_s=2.5, run_seconds=run_seconds)
    assert await learn_run_times(repo, costs, limit=10) == 1
    assert await learn_run_times(repo, costs, limit=10) == 0, "each run time is learned once"
    shapes, speeds = await repo.estimates.learned()
    assert shapes == {"tiny|4096|4|1": (2.0, 1)}
    assert set(speeds) == {W1}
