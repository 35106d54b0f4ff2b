"""A running job's writes to the database, each fenced by its attempt (a stale attempt
changes nothing), and the job events that say they landed.

An outcome (images and SUCCEEDED, a failed attempt, a cancel, a hand-back, a
suspension) is what matters: it is retried with backoff while the database is away,
for up to ``outcome_retry_s``, then given up with ``OutcomeNotStored`` (the runner
leaves the dispatch for redelivery). Results that finish together are stored in one
transaction (a group commit). Progress, DECODING and periodic checkpoints are not
retried: the next one, or the outcome, says more."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Protocol, TypeVar

from prometheus_client import Counter

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.jobs.failures import Failure
from gpu_worker.metrics import CHECKPOINTS, SUSPENSIONS
from services.backoff import Backoff
from services.bus.dispatch import Dispatch
from services.bus.events import Events, JobEvent
from services.coalesce import Coalescer
from services.db.records import JobRecord
from services.db.repository import Repository, Result, Standing, StartRequest, StepReport
from services.db.states import JobStatus
from services.errors import StoreError
from services.generation import JobInputs
from services.telemetry import logs
from services.telemetry.metrics import ATTEMPTS_FAILED, JOBS_FINISHED, REQUEUES

log = logging.getLogger(__name__)

T = TypeVar("T")


class OutcomeNotStored(Exception):
    pass


def _now() -> datetime:
    return datetime.now(UTC)


def as_sampled(job: JobRecord) -> JobRecord:
    """The job as the sampler runs it: a job whose prompt was expanded at submit is
    made from the expanded prompt, stored on it, on every attempt and every worker
    (its conditioning, its prompt cache key, its resumption alike)."""
    if not job.expanded_prompt:
        return job
    return replace(job, params=replace(job.params, prompt=job.expanded_prompt))


def _published(dispatch: Dispatch) -> datetime | None:
    return datetime.fromtimestamp(dispatch.published_at, UTC) if dispatch.published_at else None


class _FencedEnd(Protocol):
    """A write that ends an attempt if it is still the job's current one."""

    def __call__(self, job_id: str, attempt: int, worker_id: str, *, now: datetime) -> Awaitable[bool]: ...


class JobStore:
    def __init__(self, repo: Repository, events: Events, worker_id: str, *, outcome_retry_s: float) -> None:
        self.repo = repo
        self.events = events
        self.worker_id = worker_id
        self.outcome_retry_s = outcome_retry_s
        self._results = Coalescer(self._finish_many)

    async def _retried(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.outcome_retry_s
        backoff = Backoff(max_s=2.0)
        while True:
            try:
                return await call()
            except StoreError as exc:
                if time.monotonic() + backoff.next_s > deadline:
                    raise OutcomeNotStored(f"cannot store {what}: {exc}") from exc
                log.warning("cannot store %s, retrying in %.1fs: %s", what, backoff.next_s, exc)
                await backoff.wait()

    async def start(self, dispatches: Sequence[Dispatch]) -> dict[str, JobRecord]:
        """Marks the attempts RUNNING here, in one statement; the jobs that are, by id
        (one cancelled, requeued or of a stale attempt is left out), each as it is
        sampled (``as_sampled``)."""
        requests = [StartRequest(d.job_id, d.attempt, _published(d)) for d in dispatches]
        started = await self._retried(
            f"the start of {len(requests)} jobs",
            lambda: self.repo.attempts.start_many(requests, self.worker_id, now=_now()),
        )
        return {job_id: as_sampled(job) for job_id, job in started.items()}

    async def running(self, jobs: Sequence[JobRecord]) -> None:
        await self.events.job(
            *(JobEvent(job.id, job.attempt, JobStatus.RUNNING) for job in jobs),
            # Its resumption joined its record: streams read it from there.
            *(JobEvent(job.id, job.attempt) for job in jobs if job.checkpoint_step > 0),
        )

    async def inputs(self, jobs: Sequence[JobRecord]) -> dict[str, JobInputs]:
        """The input images (and masks) of these jobs, by id."""
        return await self._retried(
            f"the input images of {len(jobs)} jobs", lambda: self.repo.jobs.inputs([job.id for job in jobs])
        )

    async def load_checkpoints(self, jobs: Sequence[JobRecord]) -> dict[str, Checkpoint]:
        """The checkpoint each job resumes from. One that cannot be read now costs
        its job the steps it saved, not the job."""
        if not jobs:
            return {}
        try:
            stored = await self.repo.checkpoints.load(jobs)
        except StoreError as exc:
            log.warning(
                "cannot read the checkpoints of %d jobs; they start from step 0: %s",
                len(jobs),
                exc,
                extra=logs.jobs_fields(j.id for j in jobs),
            )
            return {}
        for job in jobs:
            if job.id not in stored:
                log.warning(
                    "job %s: its checkpoint at step %d is not stored; starting from step 0",
                    job.id,
                    job.checkpoint_step,
                    extra=logs.job_fields(job.id, job.attempt),
                )
        return {job_id: Checkpoint(c.step, c.total, c.data) for job_id, c in stored.items()}

    async def progress(self, reports: Sequence[StepReport]) -> dict[str, Standing]:
        """Records the progress of a batch's jobs; what each attempt learns back, by
        job id, or nothing if the database is away."""
        try:
            return await self.repo.attempts.progress_many(reports, self.worker_id)
        except StoreError as exc:
            log.debug("progress of %d jobs not recorded: %s", len(reports), exc)
            return {}

    async def suspend_reasons(self, job_ids: Sequence[str]) -> dict[str, str]:
        """Why the scheduler asked these jobs to suspend; nothing if the database is away."""
        try:
            return await self.repo.checkpoints.suspend_reasons(job_ids)
        except StoreError as exc:
            log.debug("suspend reasons of %d jobs not read: %s", len(job_ids), exc)
            return {}

    async def save_checkpoint(self, job: JobRecord, checkpoint: Checkpoint) -> bool:
        """A periodic checkpoint; False if the attempt is not current, or a later one is stored."""
        return await self.repo.checkpoints.save(
            job.id,
            job.attempt,
            self.worker_id,
            step=checkpoint.step,
            total=checkpoint.total,
            data=checkpoint.data,
            now=_now(),
        )

    async def decoding(self, jobs: Sequence[JobRecord], now: datetime, sampling_began: datetime) -> set[str]:
        """Records the sampled jobs DECODING (and when their sampling began); the ids
        that are (none while the database is away: their outcomes will be recorded)."""
        try:
            marked = await self.repo.attempts.decoding(
                [(j.id, j.attempt) for j in jobs], self.worker_id, now=now, sampling_began=sampling_began
            )
        except StoreError as exc:
            log.warning(
                "cannot record %d jobs decoding (their outcomes will be): %s",
                len(jobs),
                exc,
                extra=logs.jobs_fields(j.id for j in jobs),
            )
            return set()
        await self.events.job(*(JobEvent(j.id, j.attempt, JobStatus.DECODING) for j in jobs if j.id in marked))
        return marked

    async def succeed(self, result: Result) -> bool:
        """Stores the images and SUCCEEDED; False if the attempt was no longer current."""
        return await self._retried(f"the result of {result.job_id}", lambda: self._results(result))

    async def _finish_many(self, results: list[Result]) -> list[bool]:
        """Results that finished together, stored in one transaction; each one's
        SUCCEEDED published, and the schedulers told that this worker has room."""
        stored = await self.repo.attempts.finish_many(results, self.worker_id)
        JOBS_FINISHED.labels(outcome="succeeded").inc(len(stored))
        await self.events.job(
            *(JobEvent(r.job_id, r.attempt, JobStatus.SUCCEEDED) for r in results if r.job_id in stored)
        )
        await self.events.work()
        return [r.job_id in stored for r in results]

    async def fail(self, job: JobRecord, failure: Failure, *, gpu_seconds: float = 0.0) -> None:
        """Records the attempt's failure; ``gpu_seconds``, what it sampled, is charged
        only if the failure is the job's own."""
        status = await self._retried(
            f"the failure of {job.id}",
            lambda: self.repo.attempts.fail(
                job.id,
                job.attempt,
                self.worker_id,
                failure.error,
                retryable=failure.retryable,
                now=_now(),
                gpu_seconds=gpu_seconds,
            ),
        )
        if status is not None:
            ATTEMPTS_FAILED.labels(cause=failure.cause).inc()
            if status == JobStatus.QUEUED:
                REQUEUES.labels(cause=failure.cause).inc()
            else:
                JOBS_FINISHED.labels(outcome=status.value.lower()).inc()
        await self._ended(job, status)

    async def cancel(self, job: JobRecord, *, gpu_seconds: float = 0.0) -> None:
        def write(job_id: str, attempt: int, worker_id: str, *, now: datetime) -> Awaitable[bool]:
            return self.repo.attempts.cancel(job_id, attempt, worker_id, now=now, gpu_seconds=gpu_seconds)

        await self._end_as(job, JobStatus.CANCELLED, "the cancel", write, JOBS_FINISHED.labels(outcome="cancelled"))

    async def hand_back(self, job: JobRecord) -> None:
        write = self.repo.attempts.hand_back
        await self._end_as(job, JobStatus.QUEUED, "the hand-back", write, REQUEUES.labels(cause="handed back"))

    async def _end_as(
        self,
        job: JobRecord,
        status: JobStatus,
        what: str,
        write: _FencedEnd,
        counted: Counter,
    ) -> None:
        """Ends the attempt in ``status`` by ``write``, fenced by the attempt."""
        done = await self._retried(
            f"{what} of {job.id}", lambda: write(job.id, job.attempt, self.worker_id, now=_now())
        )
        if done:
            counted.inc()
        await self._ended(job, status if done else None)

    async def suspend(
        self,
        job: JobRecord,
        checkpoint: Checkpoint | None,
        *,
        reason: str,
        preempted: bool,
        at: datetime,
        gpu_seconds: float = 0.0,
    ) -> None:
        """Stores the job's checkpoint (None: it keeps the stored one, and its
        suspension is at that one's step) and puts it back in the queue, no attempt
        counted, as of ``at``, when its sampling stopped."""
        step = checkpoint.step if checkpoint is not None else job.checkpoint_step
        total = checkpoint.total if checkpoint is not None else job.params.steps
        data = checkpoint.data if checkpoint is not None else None
        status = await self._retried(
            f"the suspension of {job.id}",
            lambda: self.repo.checkpoints.suspend(
                job.id,
                job.attempt,
                self.worker_id,
                step=step,
                total=total,
                data=data,
                reason=reason,
                preempted=preempted,
                now=at,
                gpu_seconds=gpu_seconds,
            ),
        )
        log.info("job %s suspended at step %d/%d (%s): %s", job.id, step, total, reason, status)
        if status == JobStatus.QUEUED:
            SUSPENSIONS.labels(cause="preempted" if preempted else "drain").inc()
            if step > 0:
                CHECKPOINTS.labels(kind="suspension").inc()
        elif status == JobStatus.CANCELLED:
            JOBS_FINISHED.labels(outcome="cancelled").inc()
        if status is not None:
            await self.events.job(JobEvent(job.id, job.attempt))  # its suspension joined its record
        await self._ended(job, status)

    async def _ended(self, job: JobRecord, status: JobStatus | None) -> None:
        """Publishes where the job went (if this attempt was still its current one)."""
        if status is not None:
            await self.events.job(JobEvent(job.id, job.attempt, status))
        await self.events.work()
