"""Running one dispatched job to a stored outcome.

The outcome (images and SUCCEEDED, a failed attempt, a cancel, a hand-back) is
what matters: it is retried with backoff while the database is away, and if it
stays away the dispatch is left unacked for JetStream to redeliver. A database or
bus error never marks a job FAILED; one job's failure never stops the process."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import torch

from gpu_worker.decoders import Decoders, DecodeUnavailable
from gpu_worker.engine import BadOutput, BatchMember, SamplerEngine, SampleRequest
from gpu_worker.tracker import JobTracker, JobWatch, StopReason
from services import tracing
from services.backoff import Backoff
from services.bus import Dispatch
from services.chunks import split
from services.db.records import ImageRecord, JobRecord
from services.db.repository import Repository, Standing
from services.errors import InvalidArgument, JobInterrupted, StoreError
from services.models.registry import DEFAULT_TIMEOUT_S
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2

log = logging.getLogger("darkroom.gpu_worker.runner")

# Progress is written to Postgres at most this often; the gRPC stream gets every step.
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


@dataclass(frozen=True)
class SampledBatch:
    seconds: float  # the GPU's time on the batch: free for the next once its latents are out
    rows: int  # images in it
    learnable: bool  # its model was warm: the time says how long such batches take


def _now() -> datetime:
    return datetime.now(UTC)


class JobRunner:
    def __init__(
        self,
        repo: Repository,
        engine: SamplerEngine,
        decoders: Decoders,
        tracker: JobTracker,
        worker_id: str,
        *,
        outcome_retry_s: float,
        unfit_after_failures: int,
    ) -> None:
        self.repo = repo
        self.engine = engine
        self.decoders = decoders
        self.tracker = tracker
        self.worker_id = worker_id
        self.outcome_retry_s = outcome_retry_s
        # Attempts in a row that failed for reasons not the job's own: a sign that
        # this worker (its GPU, its driver) is not fit for work.
        self.failures_in_a_row = 0
        self.unfit_after_failures = unfit_after_failures
        self._warmed_up: set[str] = set()  # models that have run a job since they loaded

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

    async def start(self, dispatch: Dispatch) -> Started | Outcome:
        """Marks the attempt RUNNING (fenced) and opens its watch; an Outcome when
        there is nothing to run: not this worker's, or the database stayed away."""
        try:
            job = await self._store(
                f"the start of {dispatch.job_id}",
                lambda: self.repo.attempts.start(
                    dispatch.job_id,
                    dispatch.attempt,
                    self.worker_id,
                    now=_now(),
                    dispatched_at=datetime.fromtimestamp(dispatch.published_at, UTC) if dispatch.published_at else None,
                ),
            )
        except OutcomeNotStored as exc:
            log.warning("%s; leaving it for redelivery", exc)
            return Outcome.NOT_STORED
        if job is None:
            # Cancelled before it started, requeued, or a stale attempt: nothing to run.
            log.info("dropping %s attempt %d: not this worker's to run", dispatch.job_id, dispatch.attempt)
            return Outcome.STORED
        watch = self.tracker.open(job.id, job.attempt)
        await watch.emit(sampler_pb2.SamplerEvent(stage=sampler_pb2.SAMPLER_STAGE_RUNNING))
        spec = self.engine.registry.models.get(job.model)
        timeout_s = spec.timeout_s if spec is not None else DEFAULT_TIMEOUT_S
        timer = asyncio.get_running_loop().call_later(timeout_s, watch.stop, StopReason.TIMED_OUT)
        return Started(job, watch, timer, timeout_s)

    async def sample(self, batch: Sequence[Started]) -> SampledBatch:
        """Runs the batch's denoising loops together and leaves each member's latents
        (or what ended it) on it. If the batch as a whole fails, its members run
        again one by one, so that a job that broke it fails alone."""
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
                log.warning("a batch of %d failed (%s); running its jobs one by one", len(batch), exc)
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
        if any(isinstance(r, torch.Tensor) for r in results):
            self._warmed_up.add(model)
        rows = sum(s.job.num_images for s in batch)
        tracing.sampled(batch, seconds=seconds, rows=rows, worker_id=self.worker_id)
        # A batch that loaded or warmed up its model says little about how long batches take.
        return SampledBatch(seconds, rows, learnable=was_warm)

    async def finish(self, started: Started, *, busy_s: float, run_seconds: float | None, batch_rows: int) -> Outcome:
        """Takes a sampled job to its stored outcome: decoded and SUCCEEDED, or
        failed, cancelled or handed back as its result says."""
        try:
            await self._finish(started, busy_s, run_seconds, batch_rows)
            return Outcome.STORED
        except OutcomeNotStored as exc:
            log.warning("job %s: %s; leaving it for redelivery", started.job.id, exc)
            return Outcome.NOT_STORED
        finally:
            started.timer.cancel()
            await started.watch.emit(sampler_pb2.SamplerEvent(finished=True))

    async def _finish(self, started: Started, busy_s: float, run_seconds: float | None, batch_rows: int) -> None:
        job, watch = started.job, started.watch
        attempt = (job.id, job.attempt, self.worker_id)
        try:
            if isinstance(started.result, BaseException):
                raise started.result
            if started.result is None:
                raise RuntimeError("the job was never sampled")
            try:
                await self.repo.attempts.decoding(*attempt, now=_now())
            except StoreError as exc:
                log.warning("job %s: cannot record decoding (the outcome will be): %s", job.id, exc)
            await watch.emit(sampler_pb2.SamplerEvent(stage=sampler_pb2.SAMPLER_STAGE_DECODING))
            images = await self.decoders.decode(job, started.result)
            decoded_at = _now()
            if watch.stopping.is_set():
                raise JobInterrupted(job.id)
            stored = await self._store(
                f"the result of {job.id}",
                lambda: self.repo.attempts.finish(
                    *attempt,
                    images,
                    now=_now(),
                    busy_s=busy_s,
                    run_seconds=run_seconds,
                    batch_rows=batch_rows,
                    decoded_at=decoded_at,
                ),
            )
            self.failures_in_a_row = 0
            tracing.stored(job, worker_id=self.worker_id, decoded_at=decoded_at, stored=stored)
            if stored:
                for image in images:
                    for chunk in image_chunks(image):
                        await watch.emit(sampler_pb2.SamplerEvent(output=chunk))
            log.info("job %s done (stored=%s)", job.id, stored)
        except JobInterrupted:
            await self._interrupted(job, watch.stop_reason, started.timeout_s)
        except OutcomeNotStored:
            raise
        except InvalidArgument as exc:
            # The job's own fault: another attempt would fail the same way.
            fault = str(exc)
            log.warning("job %s failed: %s", job.id, fault)
            await self._store(
                f"the failure of {job.id}",
                lambda: self.repo.attempts.fail(*attempt, fault, retryable=False, now=_now()),
            )
        except Exception as exc:
            # The GPU, the model, a bad output, the decoders: another attempt, on
            # another GPU, may do. Decoders being away says nothing about this worker.
            if not isinstance(exc, DecodeUnavailable):
                self.failures_in_a_row += 1
            log.warning(
                "job %s attempt %d failed: %s", job.id, job.attempt, exc, exc_info=not isinstance(exc, BadOutput)
            )
            error = f"{type(exc).__name__}: {exc}"
            await self._store(
                f"the failure of {job.id}",
                lambda: self.repo.attempts.fail(*attempt, error, retryable=True, now=_now()),
            )

    async def _interrupted(self, job: JobRecord, reason: StopReason | None, timeout_s: float) -> None:
        attempt = (job.id, job.attempt, self.worker_id)
        log.info("job %s attempt %d stopped: %s", job.id, job.attempt, reason.value if reason else "?")
        if reason == StopReason.CANCELLED:
            await self._store(f"the cancel of {job.id}", lambda: self.repo.attempts.cancel(*attempt, now=_now()))
        elif reason == StopReason.TIMED_OUT:
            error = f"ran past the {timeout_s:.0f}s timeout of {job.model}"
            await self._store(
                f"the timeout of {job.id}",
                lambda: self.repo.attempts.fail(*attempt, error, retryable=True, now=_now()),
            )
        elif reason == StopReason.HANDED_BACK:
            await self._store(f"the hand-back of {job.id}", lambda: self.repo.attempts.hand_back(*attempt, now=_now()))
        # SUPERSEDED: the job is another attempt's now; nothing of ours to record.

    def _member(self, started: Started, loop: asyncio.AbstractEventLoop) -> BatchMember:
        """The job as a batch member: its progress goes to its watchers at every step
        and to the database at most every PROGRESS_WRITE_EVERY_S."""
        job, watch = started.job, started.watch
        last_write = 0.0

        async def record(step: int, total: int) -> None:
            try:
                standing = await self.repo.attempts.progress(job.id, job.attempt, self.worker_id, step, total)
            except StoreError as exc:
                log.debug("progress of %s not recorded: %s", job.id, exc)
                return
            if standing == Standing.CANCEL_REQUESTED:
                watch.stop(StopReason.CANCELLED)
            elif standing == Standing.SUPERSEDED:
                watch.stop(StopReason.SUPERSEDED)

        def on_step(step: int, total: int) -> None:
            nonlocal last_write
            progress = sampler_pb2.SamplerProgress(step=step, total=total)
            watch.emit_threadsafe(sampler_pb2.SamplerEvent(progress=progress))
            if step == total or time.monotonic() - last_write >= PROGRESS_WRITE_EVERY_S:
                last_write = time.monotonic()
                asyncio.run_coroutine_threadsafe(record(step, total), loop)

        request = SampleRequest(
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
        return BatchMember(request, on_step, watch.stopping)


def image_chunks(image: ImageRecord) -> list[sampler_pb2.SamplerOutputChunk]:
    return [
        sampler_pb2.SamplerOutputChunk(
            index=image.index,
            offset=offset,
            data=data,
            last=last,
            mime_type=image.mime_type,
            width=image.width,
            height=image.height,
            seed=image.seed,
        )
        for offset, data, last in split(image.data)
    ]
