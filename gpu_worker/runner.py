"""Running dispatched jobs to stored outcomes, a batch at a time: start (RUNNING, one
statement), sample (the denoising loops together, off the event loop), decode (the
batch in one call) and finish (each job's outcome stored; the results that finish
together in one transaction).

The outcome is what matters: the ``JobStore`` retries it while the database is
away, and if it stays away the dispatch is left unacked (``Outcome.NOT_STORED``)
for JetStream to redeliver. A database or bus error never marks a job FAILED; one
job's failure never stops the process; failures in a row that are not the jobs' own
make the worker unfit."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from gpu_worker import spans
from gpu_worker.checkpoint_format import Checkpoint
from gpu_worker.checkpoint_writer import PeriodicCheckpointWriter
from gpu_worker.decoders import Decoders
from gpu_worker.denoising import BatchMember, MemberInputs, MemberResult
from gpu_worker.edit_inputs import EditInputs
from gpu_worker.engine import SamplerEngine
from gpu_worker.failures import FailureStreak
from gpu_worker.job_store import JobStore, OutcomeNotStored
from gpu_worker.metrics import BATCH_IMAGES
from gpu_worker.outcomes import Decoded, Outcome, OutcomeRecorder, Started
from gpu_worker.previews import preview_steps
from gpu_worker.progress import BatchProgress
from gpu_worker.tracker import JobTracker, StopReason
from services.bus.dispatch import Dispatch
from services.db.records import JobRecord
from services.db.repository import Result
from services.models.registry import DEFAULT_TIMEOUT_S, ModelFamily
from services.telemetry import logs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledBatch:
    seconds: float  # the GPU's time on the batch: free for the next once its latents are out
    rows: int  # images in it
    learnable: bool  # its model was warm: the time says how long such batches take
    # Recording its jobs DECODING, under way while they decode: their outcomes wait for it.
    recorded: asyncio.Future[None] | None = None


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        engine: SamplerEngine,
        decoders: Decoders,
        tracker: JobTracker,
        *,
        unfit_after_failures: int,
    ) -> None:
        self.store = store
        self.engine = engine
        self.decoders = decoders
        self.tracker = tracker
        self.worker_id = store.worker_id
        self.failures = FailureStreak(unfit_after_failures)
        self.outcomes = OutcomeRecorder(store, self.failures)
        self.edit_inputs = EditInputs(store, decoders)
        self._warmed_up: set[str] = set()  # models that have run a job since they loaded

    @property
    def unfit(self) -> bool:
        return self.failures.unfit

    def warmed_up(self, model: str) -> None:
        self._warmed_up.add(model)

    def forget_warm_up(self, model: str) -> None:
        self._warmed_up.discard(model)

    # -- start ---------------------------------------------------------------------

    async def start(self, dispatches: Sequence[Dispatch]) -> dict[str, Started | Outcome]:
        """Marks the attempts RUNNING and opens their watches; per job id, what
        started, or an Outcome when there is nothing to run: not this worker's, or
        the database stayed away."""
        try:
            jobs = await self.store.start(dispatches)
        except OutcomeNotStored as exc:
            log.warning("%s; leaving them for redelivery", exc, extra=logs.jobs_fields(d.job_id for d in dispatches))
            return {d.job_id: Outcome.NOT_STORED for d in dispatches}
        resumes = await self.store.load_checkpoints([job for job in jobs.values() if job.checkpoint_step > 0])
        out: dict[str, Started | Outcome] = {}
        for d in dispatches:
            job = jobs.get(d.job_id)
            if job is None:
                # Cancelled before it started, requeued, or a stale attempt: nothing to run.
                extra = logs.job_fields(d.job_id, d.attempt)
                log.info("dropping %s attempt %d: not this worker's to run", d.job_id, d.attempt, extra=extra)
                out[d.job_id] = Outcome.STORED
            else:
                out[d.job_id] = self._watched(job, resumes.get(job.id))
        await self.store.running([s.job for s in out.values() if isinstance(s, Started)])
        return out

    def _watched(self, job: JobRecord, resume: Checkpoint | None) -> Started:
        watch = self.tracker.open(job.id, job.attempt)
        spec = self.engine.registry.models.get(job.params.model)
        timeout_s = spec.timeout_s if spec is not None else DEFAULT_TIMEOUT_S
        timer = asyncio.get_running_loop().call_later(timeout_s, watch.stop, StopReason.TIMED_OUT)
        return Started(job, watch, timer, timeout_s, resume=resume)

    # -- sample --------------------------------------------------------------------

    async def prepare(self, batch: Sequence[Started]) -> None:
        """What the batch needs before its first step, made while the device runs the
        batch before it: its edits' and upscales' input images, and its prompts
        encoded into the prompt cache."""
        inputs = await self._inputs(batch)
        for started in batch:
            started.inputs = inputs.get(started.job.id)
            started.prepared = True
        runnable = [s.job.params for s in batch if not isinstance(s.inputs, BaseException)]
        try:
            await asyncio.to_thread(self.engine.encode_prompts, runnable)
        except Exception as exc:
            # The batch encodes them as it starts, where a bad prompt fails its job alone.
            log.debug("prompts not encoded ahead: %s", exc, extra=logs.jobs_fields(s.job.id for s in batch))

    async def sample(self, batch: Sequence[Started]) -> SampledBatch:
        """Runs the batch's denoising loops together and leaves each member's latents
        (or what ended it) on it; the members with latents are then recorded
        DECODING, together, while the batch goes on to decode."""
        model = batch[0].job.params.model
        was_warm = model in self._warmed_up
        loop = asyncio.get_running_loop()
        if not all(s.prepared for s in batch):
            await self.prepare([s for s in batch if not s.prepared])
        # A job whose input could not be made fails (or waits) alone; the rest run.
        runnable = [s for s in batch if not isinstance(s.inputs, BaseException)]
        progress = BatchProgress(self.store, self.store.events, loop)
        members = [self._member(s, loop, progress) for s in runnable]
        began_at = datetime.now(UTC)
        began = time.perf_counter()
        results = dict(zip((s.job.id for s in runnable), await self._sample(runnable, members), strict=True))
        seconds = time.perf_counter() - began
        for started in batch:
            own = started.inputs
            started.result = own if isinstance(own, BaseException) else results[started.job.id]
            started.watch.sampled = True
            started.sampling_at = began_at
        rows = sum(s.job.params.num_images for s in batch)
        BATCH_IMAGES.labels(model=model).observe(rows)
        spans.sampled(batch, seconds=seconds, rows=rows, worker_id=self.worker_id)
        sampled = [s for s in batch if isinstance(s.result, torch.Tensor) and not s.watch.discards_work]
        recorded = None
        if sampled:
            self._warmed_up.add(model)
            recorded = asyncio.ensure_future(self._decoding(sampled, began_at))
        # A batch that loaded or warmed up its model says little about how long
        # batches take; nor does one that resumed a job part of the way through.
        whole = all(s.resume is None and s.job.params.first_step() == 0 for s in batch)
        return SampledBatch(seconds, rows, learnable=was_warm and whole, recorded=recorded)

    async def _inputs(self, batch: Sequence[Started]) -> dict[str, MemberInputs | BaseException]:
        """Each edit's and upscale's input, as its model takes it, or what kept it from it."""
        try:
            return await self.edit_inputs.prepare([s.job for s in batch])
        except Exception as exc:  # the database stayed away: the outcome says so
            return {s.job.id: exc for s in batch if s.job.params.image_digest}

    async def _sample(self, batch: Sequence[Started], members: list[BatchMember]) -> list[MemberResult]:
        """The members' results. If the batch as a whole fails, its members run again
        one by one, so that a job that broke it fails alone."""
        if not members:
            return []
        try:
            return await asyncio.to_thread(self.engine.sample_batch, members)
        except Exception as exc:
            if len(members) == 1:
                return [exc]
            extra = logs.jobs_fields(s.job.id for s in batch)
            log.warning("a batch of %d failed (%s); running its jobs one by one", len(batch), exc, extra=extra)
        results: list[MemberResult] = []
        for member in members:
            try:
                [result] = await asyncio.to_thread(self.engine.sample_batch, [member])
            except Exception as alone:
                result = alone
            results.append(result)
        return results

    def _member(self, started: Started, loop: asyncio.AbstractEventLoop, batch: BatchProgress) -> BatchMember:
        """The job as a batch member: its steps reported, its periodic checkpoints stored."""
        job, watch = started.job, started.watch
        resumed_from = started.resume.step if started.resume is not None else 0
        spec = self.engine.registry.models.get(job.params.model)
        family = spec.family if spec is not None else ModelFamily.SD15
        progress = batch.member(job, watch, resumed_from=resumed_from, family=family)
        save = functools.partial(self.store.save_checkpoint, job)
        started.writer = PeriodicCheckpointWriter(job.id, job.attempt, save, loop)
        inputs = started.inputs
        return BatchMember(
            job.params,
            progress.on_step,
            watch.stopping,
            resume=started.resume,
            on_checkpoint=started.writer.offer,
            suspend=lambda: watch.suspending,
            inputs=inputs if isinstance(inputs, MemberInputs) else None,
            preview_at=preview_steps(job.params.steps, job.previews),
            on_preview=progress.on_preview,
        )

    async def _decoding(self, sampled: Sequence[Started], began_at: datetime) -> None:
        now = datetime.now(UTC)
        marked = await self.store.decoding([s.job for s in sampled], now, began_at)
        for s in sampled:
            if s.job.id in marked:
                s.decoding_at = now

    # -- decode and finish -----------------------------------------------------------

    async def finish(self, batch: Sequence[Started], sampled: SampledBatch) -> list[Outcome]:
        """Takes a sampled batch's jobs to their stored outcomes, per job in order:
        decoded (the batch in one call) and SUCCEEDED, or failed, cancelled, handed
        back or suspended as each one's result says. The batch's time is learned
        once, from its first member, under its rows."""
        latents = [(s.job, s.result) for s in batch if isinstance(s.result, torch.Tensor) and not s.watch.discards_work]
        decoded = await self.decoders.decode_many(latents) if latents else {}
        decoded_at = datetime.now(UTC)
        if sampled.recorded is not None:
            await sampled.recorded  # DECODING before SUCCEEDED, in the database and on the stream
        outcomes = []
        for i, started in enumerate(batch):
            # What its result will say, but its images: what the batch measured.
            result = Result(
                started.job.id,
                started.job.attempt,
                (),
                decoded_at,
                # Shared by images: a job of two images in a batch of four used half of it.
                busy_s=sampled.seconds * started.job.params.num_images / sampled.rows,
                run_seconds=sampled.seconds if sampled.learnable and i == 0 else None,
                batch_rows=sampled.rows,
            )
            outcomes.append(self._finish_one(started, decoded.get(started.job.id), result))
        return list(await asyncio.gather(*outcomes))

    async def _finish_one(self, started: Started, decoded: Decoded, result: Result) -> Outcome:
        try:
            return await self.outcomes.record(started, decoded, result)
        finally:
            started.timer.cancel()
            self.tracker.finished(started.watch)
