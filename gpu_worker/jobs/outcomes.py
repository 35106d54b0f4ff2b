"""A job started here, and the outcome it comes to, stored: its images and SUCCEEDED,
a failed attempt (``gpu_worker.jobs.failures`` says what the failure means), a cancel, a
hand-back, or a suspension with its checkpoint, as its sampling, its decoding and
its watch say.

An outcome the ``JobStore`` could not store (the database stayed away) is
``Outcome.NOT_STORED``: its dispatch is left for JetStream to redeliver."""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from gpu_worker import spans
from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.checkpoints.writer import PeriodicCheckpointWriter
from gpu_worker.denoising.members import JobSuspended, MemberInputs, MemberResult
from gpu_worker.jobs.failures import Failure, FailureStreak, classify, timed_out
from gpu_worker.jobs.job_store import JobStore, OutcomeNotStored
from gpu_worker.jobs.tracker import JobWatch, StopReason
from gpu_worker.metrics import observe_stages
from services.db.records import ImageRecord, JobRecord
from services.db.repository import Result
from services.errors import JobInterrupted
from services.telemetry import logs

log = logging.getLogger(__name__)

# What decoding a job came to: its images, what kept it from having them, or None
# (it was not decoded).
Decoded = list[ImageRecord] | BaseException | None


class Outcome(enum.Enum):
    STORED = "stored"  # the job's outcome is durable, or it was not ours: ack
    NOT_STORED = "not stored"  # the database stayed away: leave it for redelivery


@dataclass
class Started:
    """A job whose attempt is RUNNING here, and, once sampled, its latents or what ended it."""

    job: JobRecord
    watch: JobWatch
    timer: asyncio.TimerHandle
    timeout_s: float
    result: MemberResult | None = None
    sampling_at: datetime | None = None  # when its batch's denoising began
    decoding_at: datetime | None = None  # when recorded DECODING
    resume: Checkpoint | None = None  # the checkpoint it starts from
    writer: PeriodicCheckpointWriter | None = None  # stores its periodic checkpoints
    prepared: bool = False  # its input image and prompt made ready (``JobRunner.prepare``)
    inputs: MemberInputs | BaseException | None = None  # its input image as its model takes it, or what kept it
    # Once sampled: its time in its batch, the images beside it (its own included,
    # on average over its steps), and, if it joined a running batch at a step
    # boundary, the images already in it then (None: it began its batch).
    sampled_s: float = 0.0
    batch_rows: int = 0
    joined_rows: int | None = None
    cached_steps: int | None = None  # steps that reused a prediction (step caching; None: off)

    def cached(self, steps: int) -> None:
        self.cached_steps = steps


class OutcomeRecorder:
    def __init__(self, store: JobStore, failures: FailureStreak) -> None:
        self.store = store
        self.failures = failures  # a stored result ends the streak; a failure may lengthen it

    async def record(self, started: Started, decoded: Decoded, result: Result) -> Outcome:
        """Stores what the job came to; ``result`` is what its result will say, but its images."""
        try:
            with logs.about_job(started.job.id, started.job.attempt):
                await self._record(started, decoded, result)
            return Outcome.STORED
        except OutcomeNotStored as exc:
            extra = logs.job_fields(started.job.id, started.job.attempt)
            log.warning("job %s: %s; leaving it for redelivery", started.job.id, exc, extra=extra)
            return Outcome.NOT_STORED

    async def _record(self, started: Started, decoded: Decoded, result: Result) -> None:
        job, watch = started.job, started.watch
        # Its share of its batch's sampling time: what its tenant is charged for
        # this attempt, unless it failed through no fault of its own.
        charged = result.busy_s
        try:
            await self._succeeded(started, replace(result, images=_images(started, decoded)))
        except OutcomeNotStored:
            raise
        except JobSuspended as exc:
            await self._suspended(started, exc.checkpoint, exc.at, charged)
        except JobInterrupted:
            if watch.suspending:
                await self._suspended(
                    started, None, datetime.now(UTC), charged
                )  # stopped with nothing of its own to save
            else:
                await self._interrupted(started, charged)
        except Exception as exc:
            await self._failed(job, classify(exc), charged)

    async def _succeeded(self, started: Started, result: Result) -> None:
        job = started.job
        stored = await self.store.succeed(result)
        self.failures.succeeded()
        if stored:
            # It started on the GPU when its batch's denoising began (claimed earlier).
            began = started.sampling_at if started.decoding_at is not None else job.started_at
            times = (job.created_at, job.scheduled_at, job.dispatched_at, began, started.decoding_at)
            observe_stages(job.params.model, (*times, result.decoded_at, datetime.now(UTC)))
        spans.stored(job, worker_id=self.store.worker_id, decoded_at=result.decoded_at, stored=stored)
        log.info("job %s done (stored=%s)", job.id, stored)

    async def _failed(self, job: JobRecord, failure: Failure, gpu_seconds: float) -> None:
        log.warning("job %s attempt %d failed: %s", job.id, job.attempt, failure.error, exc_info=failure.traceback)
        if failure.ends_worker:
            self.failures.ended(failure)
        await self.store.fail(job, failure, gpu_seconds=gpu_seconds)
        self.failures.failed(failure)

    async def _suspended(
        self, started: Started, checkpoint: Checkpoint | None, at: datetime, gpu_seconds: float
    ) -> None:
        """Back to the queue with its checkpoint, no attempt counted: the next
        attempt, on any GPU, starts where this one stopped."""
        watch = started.watch
        preempted = watch.stop_reason == StopReason.PREEMPTED
        if started.writer is not None:
            await started.writer.settled()  # a periodic write landing later would be refused anyway
        reason = watch.detail or ("preempted" if preempted else "drain")
        await self.store.suspend(
            started.job, checkpoint, reason=reason, preempted=preempted, at=at, gpu_seconds=gpu_seconds
        )

    async def _interrupted(self, started: Started, gpu_seconds: float) -> None:
        job, reason = started.job, started.watch.stop_reason
        log.info("job %s attempt %d stopped: %s", job.id, job.attempt, reason.value if reason else "?")
        if reason == StopReason.CANCELLED:
            await self.store.cancel(job, gpu_seconds=gpu_seconds)
        elif reason == StopReason.TIMED_OUT:
            await self.store.fail(job, timed_out(job.params.model, started.timeout_s))
        elif reason == StopReason.HANDED_BACK:
            await self.store.hand_back(job)
        # SUPERSEDED: the job is another attempt's now; nothing of ours to record.


def _images(started: Started, decoded: Decoded) -> list[ImageRecord]:
    """The job's images; raises what ended it instead."""
    if isinstance(started.result, BaseException):
        raise started.result
    if started.result is None:
        raise RuntimeError("the job was never sampled")
    if started.watch.discards_work or decoded is None:
        raise JobInterrupted(started.job.id)
    if isinstance(decoded, BaseException):
        raise decoded
    return decoded
