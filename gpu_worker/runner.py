"""Running dispatched jobs to stored outcomes, a batch at a time.

The outcome (images and SUCCEEDED, a failed attempt, a cancel, a hand-back) is
what matters: it is retried with backoff while the database is away, and if it
stays away the dispatch is left unacked for JetStream to redeliver. A database or
bus error never marks a job FAILED; one job's failure never stops the process.

Writes go to the database a batch at a time: the batch's jobs start in one
statement, become DECODING in one, and the results that finish together are stored
in one transaction (a group commit). Every change, and every denoising step, is
published as a job event once it is durable (``services.bus.events``)."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TypeVar

import torch

from gpu_worker.checkpoint_format import Checkpoint
from gpu_worker.checkpoint_writer import PeriodicCheckpointWriter
from gpu_worker.decoders import Decoders, DecodeUnavailable
from gpu_worker.denoising import BadOutput, BatchMember, JobSuspended
from gpu_worker.engine import SamplerEngine
from gpu_worker.metrics import BATCH_IMAGES, CHECKPOINTS, RESUMED_STEPS, SUSPENSIONS, observe_stages
from gpu_worker.tracker import JobTracker, JobWatch, StopReason
from services.backoff import Backoff
from services.bus.dispatch import Dispatch
from services.bus.events import Events, JobEvent
from services.coalesce import Coalescer
from services.db.records import ImageRecord, JobRecord
from services.db.repository import Repository, Result, Standing, StartRequest
from services.db.states import JobStatus
from services.errors import InvalidArgument, JobInterrupted, StoreError
from services.generation import GenerationParams
from services.models.registry import DEFAULT_TIMEOUT_S
from services.telemetry import logs, tracing
from services.telemetry.metrics import ATTEMPTS_FAILED, JOBS_FINISHED, REQUEUES

log = logging.getLogger(__name__)

# Progress is written to Postgres at most this often (the cancel flag comes back
# with it); job events carry every step.
PROGRESS_WRITE_EVERY_S = 0.25
T = TypeVar("T")


class Outcome(enum.Enum):
    STORED = "stored"  # the job's outcome is durable, or it was not ours: ack
    NOT_STORED = "not stored"  # the database stayed away: leave it for redelivery


class OutcomeNotStored(Exception):
    pass


@dataclass
class Started:
    """A job whose attempt is RUNNING here, and, once sampled, its latents or what ended it."""

    job: JobRecord
    watch: JobWatch
    timer: asyncio.TimerHandle
    timeout_s: float
    result: torch.Tensor | BaseException | None = None
    decoding_at: datetime | None = None  # when recorded DECODING
    resume: Checkpoint | None = None  # the checkpoint it starts from
    saver: PeriodicCheckpointWriter | None = None  # stores its periodic checkpoints


@dataclass(frozen=True)
class SampledBatch:
    seconds: float  # the GPU's time on the batch: free for the next once its latents are out
    rows: int  # images in it
    learnable: bool  # its model was warm: the time says how long such batches take
    # Recording its jobs DECODING, under way while they decode: their outcomes wait for it.
    recorded: asyncio.Future[None] | None = None


def _now() -> datetime:
    return datetime.now(UTC)


def _published(dispatch: Dispatch) -> datetime | None:
    return datetime.fromtimestamp(dispatch.published_at, UTC) if dispatch.published_at else None


class JobRunner:
    def __init__(
        self,
        repo: Repository,
        engine: SamplerEngine,
        decoders: Decoders,
        tracker: JobTracker,
        events: Events,
        worker_id: str,
        *,
        outcome_retry_s: float,
        unfit_after_failures: int,
    ) -> None:
        self.repo = repo
        self.engine = engine
        self.decoders = decoders
        self.tracker = tracker
        self.events = events
        self.worker_id = worker_id
        self.outcome_retry_s = outcome_retry_s
        # Attempts in a row that failed for reasons not the job's own: a sign that
        # this worker (its GPU, its driver) is not fit for work.
        self.failures_in_a_row = 0
        self.unfit_after_failures = unfit_after_failures
        self._warmed_up: set[str] = set()  # models that have run a job since they loaded
        self._results = Coalescer(self._store_results)

    @property
    def unfit(self) -> bool:
        return self.failures_in_a_row >= self.unfit_after_failures

    def warmed_up(self, model: str) -> None:
        self._warmed_up.add(model)

    def forget_warm_up(self, model: str) -> None:
        self._warmed_up.discard(model)

    async def _store(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Retries a write that must land while the database is away, for up to
        ``outcome_retry_s``; then gives up with OutcomeNotStored."""
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

    async def start(self, dispatches: Sequence[Dispatch]) -> dict[str, Started | Outcome]:
        """Marks the attempts RUNNING (fenced, in one statement) and opens their
        watches; per job id, what started, or an Outcome when there is nothing to
        run: not this worker's, or the database stayed away."""
        requests = [StartRequest(d.job_id, d.attempt, _published(d)) for d in dispatches]
        try:
            jobs = await self._store(
                f"the start of {len(requests)} jobs",
                lambda: self.repo.attempts.start_many(requests, self.worker_id, now=_now()),
            )
        except OutcomeNotStored as exc:
            log.warning("%s; leaving them for redelivery", exc, extra=logs.jobs_fields(d.job_id for d in dispatches))
            return {d.job_id: Outcome.NOT_STORED for d in dispatches}
        stored = await self._checkpoints([job for job in jobs.values() if job.checkpoint_step > 0])
        out: dict[str, Started | Outcome] = {}
        loop = asyncio.get_running_loop()
        for d in dispatches:
            job = jobs.get(d.job_id)
            if job is None:
                # Cancelled before it started, requeued, or a stale attempt: nothing to run.
                log.info(
                    "dropping %s attempt %d: not this worker's to run",
                    d.job_id,
                    d.attempt,
                    extra=logs.job_fields(d.job_id, d.attempt),
                )
                out[d.job_id] = Outcome.STORED
                continue
            watch = self.tracker.open(job.id, job.attempt)
            spec = self.engine.registry.models.get(job.model)
            timeout_s = spec.timeout_s if spec is not None else DEFAULT_TIMEOUT_S
            timer = loop.call_later(timeout_s, watch.stop, StopReason.TIMED_OUT)
            out[d.job_id] = Started(job, watch, timer, timeout_s, resume=stored.get(job.id))
        started = [s for s in out.values() if isinstance(s, Started)]
        await self.events.job(
            *(JobEvent(s.job.id, s.job.attempt, JobStatus.RUNNING) for s in started),
            # Its resumption joined its record: streams read it from there.
            *(JobEvent(s.job.id, s.job.attempt) for s in started if s.job.checkpoint_step > 0),
        )
        return out

    async def _checkpoints(self, jobs: Sequence[JobRecord]) -> dict[str, Checkpoint]:
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

    async def sample(self, batch: Sequence[Started]) -> SampledBatch:
        """Runs the batch's denoising loops together and leaves each member's latents
        (or what ended it) on it. If the batch as a whole fails, its members run
        again one by one, so that a job that broke it fails alone. The members with
        latents are then recorded DECODING, together."""
        model = batch[0].job.model
        was_warm = model in self._warmed_up
        loop = asyncio.get_running_loop()
        members = [self._member(started, loop) for started in batch]
        began = time.perf_counter()
        try:
            results = await asyncio.to_thread(self.engine.sample_batch, members)
        except Exception as exc:
            if len(batch) == 1:
                results = [exc]
            else:
                log.warning(
                    "a batch of %d failed (%s); running its jobs one by one",
                    len(batch),
                    exc,
                    extra=logs.jobs_fields(s.job.id for s in batch),
                )
                results = []
                for member in members:
                    try:
                        [result] = await asyncio.to_thread(self.engine.sample_batch, [member])
                    except Exception as alone:
                        result = alone
                    results.append(result)
        seconds = time.perf_counter() - began
        for started, result in zip(batch, results, strict=True):
            started.result = result
            started.watch.sampled = True
        rows = sum(s.job.num_images for s in batch)
        BATCH_IMAGES.labels(model=model).observe(rows)
        tracing.sampled(batch, seconds=seconds, rows=rows, worker_id=self.worker_id)
        sampled = [s for s in batch if isinstance(s.result, torch.Tensor) and not s.watch.discards_work]
        recorded = None
        if sampled:
            self._warmed_up.add(model)
            # Not on the way to the image: the batch decodes meanwhile.
            recorded = asyncio.ensure_future(self._decoding(sampled))
        # A batch that loaded or warmed up its model says little about how long
        # batches take; nor does one that resumed a job part of the way through.
        whole = all(s.resume is None for s in batch)
        return SampledBatch(seconds, rows, learnable=was_warm and whole, recorded=recorded)

    async def _decoding(self, sampled: Sequence[Started]) -> None:
        now = _now()
        try:
            marked = await self.repo.attempts.decoding(
                [(s.job.id, s.job.attempt) for s in sampled], self.worker_id, now=now
            )
        except StoreError as exc:
            log.warning(
                "cannot record %d jobs decoding (their outcomes will be): %s",
                len(sampled),
                exc,
                extra=logs.jobs_fields(s.job.id for s in sampled),
            )
            return
        for s in sampled:
            if s.job.id in marked:
                s.decoding_at = now
        await self.events.job(
            *(JobEvent(s.job.id, s.job.attempt, JobStatus.DECODING) for s in sampled if s.decoding_at is not None)
        )

    async def finish(self, batch: Sequence[Started], sampled: SampledBatch) -> list[Outcome]:
        """Takes a sampled batch's jobs to their stored outcomes, per job in order:
        decoded (the batch in one call) and SUCCEEDED, or failed, cancelled or handed
        back as each one's result says. The batch's time is learned once, from its
        first member, under its rows."""
        latents = [(s.job, s.result) for s in batch if isinstance(s.result, torch.Tensor) and not s.watch.discards_work]
        decoded = await self.decoders.decode_many(latents) if latents else {}
        decoded_at = _now()
        if sampled.recorded is not None:
            await sampled.recorded  # DECODING before SUCCEEDED, in the database and on the stream
        # What each job's result will say, but its images: what the batch measured.
        results = [
            Result(
                started.job.id,
                started.job.attempt,
                (),
                decoded_at,
                busy_s=sampled.seconds / len(batch),
                run_seconds=sampled.seconds if sampled.learnable and i == 0 else None,
                batch_rows=sampled.rows,
            )
            for i, started in enumerate(batch)
        ]
        return list(
            await asyncio.gather(
                *(
                    self._finish_one(started, decoded.get(started.job.id), result)
                    for started, result in zip(batch, results, strict=True)
                )
            )
        )

    async def _finish_one(
        self, started: Started, decoded: list[ImageRecord] | BaseException | None, result: Result
    ) -> Outcome:
        try:
            with logs.about_job(started.job.id, started.job.attempt):
                await self._finish(started, decoded, result)
            return Outcome.STORED
        except OutcomeNotStored as exc:
            log.warning(
                "job %s: %s; leaving it for redelivery",
                started.job.id,
                exc,
                extra=logs.job_fields(started.job.id, started.job.attempt),
            )
            return Outcome.NOT_STORED
        finally:
            started.timer.cancel()
            self.tracker.finished(started.watch)

    async def _finish(
        self, started: Started, decoded: list[ImageRecord] | BaseException | None, result: Result
    ) -> None:
        job, watch = started.job, started.watch
        try:
            if isinstance(started.result, BaseException):
                raise started.result
            if started.result is None:
                raise RuntimeError("the job was never sampled")
            if watch.discards_work or decoded is None:
                raise JobInterrupted(job.id)
            if isinstance(decoded, BaseException):
                raise decoded
            if watch.discards_work:
                raise JobInterrupted(job.id)
            result = replace(result, images=decoded)
            stored = await self._store(f"the result of {job.id}", lambda: self._results(result))
            self.failures_in_a_row = 0
            if stored:
                times = (job.created_at, job.scheduled_at, job.dispatched_at, job.started_at, started.decoding_at)
                observe_stages(job.model, (*times, result.decoded_at, _now()))
            tracing.stored(job, worker_id=self.worker_id, decoded_at=result.decoded_at, stored=stored)
            log.info("job %s done (stored=%s)", job.id, stored)
        except JobSuspended as exc:
            await self._suspended(started, exc.checkpoint)
        except JobInterrupted:
            if watch.suspending:
                await self._suspended(started, None)  # stopped with nothing of its own to save
            else:
                await self._interrupted(job, watch.stop_reason, started.timeout_s)
        except OutcomeNotStored:
            raise
        except InvalidArgument as exc:
            # The job's own fault: another attempt would fail the same way.
            fault = str(exc)
            log.warning("job %s failed: %s", job.id, fault)
            await self._failed(job, fault, retryable=False, cause="invalid input")
        except Exception as exc:
            # The GPU, the model, a bad output, the decoders: another attempt, on
            # another GPU, may do. Decoders being away says nothing about this worker.
            if not isinstance(exc, DecodeUnavailable):
                self.failures_in_a_row += 1
            log.warning(
                "job %s attempt %d failed: %s", job.id, job.attempt, exc, exc_info=not isinstance(exc, BadOutput)
            )
            cause = (
                "bad output"
                if isinstance(exc, BadOutput)
                else "decoders away"
                if isinstance(exc, DecodeUnavailable)
                else "error"
            )
            await self._failed(job, f"{type(exc).__name__}: {exc}", retryable=True, cause=cause)

    async def _store_results(self, results: list[Result]) -> list[bool]:
        """Results that finished together, stored in one transaction; each one's
        SUCCEEDED published, and the schedulers told that this worker has room."""
        stored = await self.repo.attempts.finish_many(results, self.worker_id)
        JOBS_FINISHED.labels(outcome="succeeded").inc(len(stored))
        await self.events.job(
            *(JobEvent(r.job_id, r.attempt, JobStatus.SUCCEEDED) for r in results if r.job_id in stored)
        )
        await self.events.work()
        return [r.job_id in stored for r in results]

    async def _failed(self, job: JobRecord, error: str, *, retryable: bool, cause: str) -> None:
        status = await self._store(
            f"the failure of {job.id}",
            lambda: self.repo.attempts.fail(
                job.id, job.attempt, self.worker_id, error, retryable=retryable, now=_now()
            ),
        )
        if status is not None:
            ATTEMPTS_FAILED.labels(cause=cause).inc()
            if status == JobStatus.QUEUED:
                REQUEUES.labels(cause=cause).inc()
            else:
                JOBS_FINISHED.labels(outcome=status.value.lower()).inc()
        await self._ended(job, status)

    async def _ended(self, job: JobRecord, status: JobStatus | None) -> None:
        """Publishes where the job went (if this attempt was still its current one)."""
        if status is not None:
            await self.events.job(JobEvent(job.id, job.attempt, status))
        await self.events.work()

    async def _suspended(self, started: Started, checkpoint: Checkpoint | None) -> None:
        """Stores the job's checkpoint and puts it back in the queue, no attempt
        counted: the next attempt, on any GPU, starts where this one stopped."""
        job, watch = started.job, started.watch
        preempted = watch.stop_reason == StopReason.PREEMPTED
        reason = watch.detail or ("preempted" if preempted else "drain")
        if started.saver is not None:
            await started.saver.settled()  # a periodic write landing later would be refused anyway
        step = checkpoint.step if checkpoint is not None else 0
        total = checkpoint.total if checkpoint is not None else job.steps
        status = await self._store(
            f"the suspension of {job.id}",
            lambda: self.repo.checkpoints.suspend(
                job.id,
                job.attempt,
                self.worker_id,
                step=step,
                total=total,
                data=checkpoint.data if checkpoint is not None else None,
                reason=reason,
                preempted=preempted,
                now=_now(),
            ),
        )
        log.info("job %s suspended at step %d/%d (%s): %s", job.id, step, total, reason, status)
        if status == JobStatus.QUEUED:
            SUSPENSIONS.labels(cause="preempted" if preempted else "drain").inc()
            if checkpoint is not None and checkpoint.step > 0:
                CHECKPOINTS.labels(kind="suspension").inc()
        elif status == JobStatus.CANCELLED:
            JOBS_FINISHED.labels(outcome="cancelled").inc()
        if status is not None:
            await self.events.job(JobEvent(job.id, job.attempt))  # its suspension joined its record
        await self._ended(job, status)

    async def _interrupted(self, job: JobRecord, reason: StopReason | None, timeout_s: float) -> None:
        attempt = (job.id, job.attempt, self.worker_id)
        log.info("job %s attempt %d stopped: %s", job.id, job.attempt, reason.value if reason else "?")
        if reason == StopReason.CANCELLED:
            cancelled = await self._store(
                f"the cancel of {job.id}", lambda: self.repo.attempts.cancel(*attempt, now=_now())
            )
            if cancelled:
                JOBS_FINISHED.labels(outcome="cancelled").inc()
            await self._ended(job, JobStatus.CANCELLED if cancelled else None)
        elif reason == StopReason.TIMED_OUT:
            await self._failed(
                job, f"ran past the {timeout_s:.0f}s timeout of {job.model}", retryable=True, cause="timed out"
            )
        elif reason == StopReason.HANDED_BACK:
            handed = await self._store(
                f"the hand-back of {job.id}", lambda: self.repo.attempts.hand_back(*attempt, now=_now())
            )
            if handed:
                REQUEUES.labels(cause="handed back").inc()
            await self._ended(job, JobStatus.QUEUED if handed else None)
        # SUPERSEDED: the job is another attempt's now; nothing of ours to record.

    def _member(self, started: Started, loop: asyncio.AbstractEventLoop) -> BatchMember:
        """The job as a batch member: every step goes out as a job event, and to the
        database at most every PROGRESS_WRITE_EVERY_S."""
        job, watch = started.job, started.watch
        last_write = time.monotonic()

        async def stepped(step: int, total: int, write: bool) -> None:
            await self.events.job(JobEvent(job.id, job.attempt, step=step, total=total))
            if not write:
                return
            try:
                standing = await self.repo.attempts.progress(job.id, job.attempt, self.worker_id, step, total)
            except StoreError as exc:
                log.debug("progress of %s not recorded: %s", job.id, exc, extra=logs.job_fields(job.id, job.attempt))
                return
            if standing == Standing.CANCEL_REQUESTED:
                watch.stop(StopReason.CANCELLED)
            elif standing == Standing.SUSPEND_REQUESTED:
                # The scheduler's call to this worker did not arrive; its flag did.
                watch.stop(StopReason.PREEMPTED, "preempted for waiting work")
            elif standing == Standing.SUPERSEDED:
                watch.stop(StopReason.SUPERSEDED)

        resumed_at = started.resume.step if started.resume is not None else 0

        def on_step(step: int, total: int) -> None:
            nonlocal last_write, resumed_at
            if resumed_at:
                # Its first step says whether the engine took the checkpoint (or,
                # finding it unusable, started over).
                if step == resumed_at + 1:
                    RESUMED_STEPS.inc(resumed_at)
                resumed_at = 0
            # The last step's progress is written with the DECODING that follows it.
            write = step < total and time.monotonic() - last_write >= PROGRESS_WRITE_EVERY_S
            if write:
                last_write = time.monotonic()
            asyncio.run_coroutine_threadsafe(stepped(step, total, write), loop)

        request = GenerationParams(
            job.model,
            job.prompt,
            job.negative_prompt,
            job.width,
            job.height,
            job.steps,
            job.guidance_scale,
            job.seed,
            job.num_images,
        )

        async def save(checkpoint: Checkpoint) -> bool:
            return await self.repo.checkpoints.save(
                job.id,
                job.attempt,
                self.worker_id,
                step=checkpoint.step,
                total=checkpoint.total,
                data=checkpoint.data,
                now=_now(),
            )

        started.saver = PeriodicCheckpointWriter(job.id, job.attempt, save, loop)
        return BatchMember(
            request,
            on_step,
            watch.stopping,
            resume=started.resume,
            on_checkpoint=started.saver.offer,
            suspend=lambda: watch.suspending,
        )
