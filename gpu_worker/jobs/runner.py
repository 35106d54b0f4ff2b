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
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import torch

from gpu_worker import spans
from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.checkpoints.writer import PeriodicCheckpointWriter
from gpu_worker.decoding.decoders import Decoders
from gpu_worker.denoising.members import BatchMember, MemberInputs
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.batch_sampling import BatchSampling, OnSampled, SampledBatch
from gpu_worker.jobs.edit_inputs import EditInputs
from gpu_worker.jobs.failures import FailureStreak
from gpu_worker.jobs.job_store import JobStore, OutcomeNotStored
from gpu_worker.jobs.outcomes import Decoded, Outcome, OutcomeRecorder, Started
from gpu_worker.jobs.previews import job_preview_steps
from gpu_worker.jobs.progress import BatchProgress
from gpu_worker.jobs.prompts_ahead import PromptsAhead
from gpu_worker.jobs.tracker import JobTracker, StopReason
from gpu_worker.metrics import BATCH_IMAGES
from services.bus.dispatch import Dispatch
from services.db.records import JobRecord
from services.db.repository import Result
from services.models.spec import DEFAULT_TIMEOUT_S, ModelFamily
from services.seats import OpenSeat
from services.telemetry import logs

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        engine: SamplerEngine,
        decoders: Decoders,
        tracker: JobTracker,
        *,
        unfit_after_failures: int,
        continuous_batching: bool = True,
    ) -> None:
        self.store = store
        # A running batch takes jobs of its model and size in at its step boundaries.
        self.continuous_batching = continuous_batching
        self.engine = engine
        self.decoders = decoders
        self.tracker = tracker
        self.worker_id = store.worker_id
        self.failures = FailureStreak(unfit_after_failures)
        self.outcomes = OutcomeRecorder(store, self.failures)
        # Asked only of a job whose model's text encoders the decoder service runs.
        self.edit_inputs = EditInputs(store, decoders, engine.registry, guided=lambda p: engine.classifier_free(p))
        self.prompts_ahead = PromptsAhead(engine)
        self._warmed_up: set[str] = set()  # models that have run a job since they loaded
        self._sampling: BatchSampling | None = None  # the batch on the device

    @property
    def unfit(self) -> bool:
        return self.failures.unfit

    def is_warm(self, model: str) -> bool:
        """Whether ``model`` has run a job since it loaded."""
        return model in self._warmed_up

    def warmed_up(self, model: str) -> None:
        self._warmed_up.add(model)

    def forget_warm_up(self, model: str) -> None:
        self._warmed_up.discard(model)

    # -- start ---------------------------------------------------------------------

    async def start(self, dispatches: Sequence[Dispatch]) -> dict[str, Started | Outcome]:
        """Marks the attempts RUNNING and opens their watches; per job id, what
        started, or an Outcome when there is nothing to run: not this worker's, or
        the database stayed away."""
        self.prompts_ahead.start(dispatches)  # while the start is written
        try:
            jobs = await self.store.start(dispatches)
        except OutcomeNotStored as exc:
            log.warning("%s; leaving them for redelivery", exc, extra=logs.jobs_fields(d.job_id for d in dispatches))
            self.prompts_ahead.forget(d.job_id for d in dispatches)
            return {d.job_id: Outcome.NOT_STORED for d in dispatches}
        except BaseException:
            self.prompts_ahead.forget(d.job_id for d in dispatches)
            raise
        resumes = await self.store.load_checkpoints([job for job in jobs.values() if job.checkpoint_step > 0])
        out: dict[str, Started | Outcome] = {}
        for d in dispatches:
            job = jobs.get(d.job_id)
            if job is None:
                # Cancelled before it started, requeued, or a stale attempt: nothing to run.
                extra = logs.job_fields(d.job_id, d.attempt)
                log.info("dropping %s attempt %d: not this worker's to run", d.job_id, d.attempt, extra=extra)
                self.prompts_ahead.forget([d.job_id])
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
        inputs = await self.edit_inputs.prepare([s.job for s in batch])
        for started in batch:
            started.inputs = inputs.get(started.job.id)
            started.prepared = True
        runnable = [s.job.params for s in batch if not isinstance(s.inputs, BaseException)]
        images = {
            s.job.params.image_digest: s.inputs
            for s in batch
            if isinstance(s.inputs, MemberInputs) and s.job.params.image_digest
        }
        await self.prompts_ahead.wait(s.job.id for s in batch)  # encoded ahead: cached now
        if not runnable or not self.engine.encodes_prompts(runnable[0].model):
            return
        try:
            await asyncio.to_thread(self.engine.encode_prompts, runnable, images)
        except Exception as exc:
            # The batch encodes them as it starts, where a bad prompt fails its job alone.
            log.debug("prompts not encoded ahead: %s", exc, extra=logs.jobs_fields(s.job.id for s in batch))

    async def sample(
        self, batch: Sequence[Started], on_sampled: OnSampled, on_seats: Callable[[], None] = lambda: None
    ) -> None:
        """Runs the batch's denoising loops together, and those of the jobs that
        ``join`` it at a step boundary. Each member goes to ``on_sampled`` as it
        leaves, with the others that left at that boundary, its latents (or what
        ended it) on it, and is recorded DECODING with them while they decode; every
        member goes out exactly once, whatever becomes of the batch. ``on_seats``:
        the batch has begun taking jobs in."""
        model = batch[0].job.params.model
        if not all(s.prepared for s in batch):
            await self.prepare([s for s in batch if not s.prepared])
        # A job whose input could not be made fails (or waits) alone; the rest run.
        unmade = [s for s in batch if isinstance(s.inputs, BaseException)]
        for started in unmade:
            started.result = started.inputs if isinstance(started.inputs, BaseException) else None
            started.watch.sampled = True
        if unmade:
            on_sampled(unmade, SampledBatch(learnable=False))
        runnable = [s for s in batch if s not in unmade]
        if not runnable:
            return
        sampling = BatchSampling(self, model, asyncio.get_running_loop(), on_sampled, on_seats)
        self._sampling = sampling
        try:
            await sampling.run(runnable)
        finally:
            self._sampling = None

    def join(self, batch: Sequence[Started]) -> bool:
        """Whether the jobs (started, prepared) join the batch on the device at its
        next step boundary; False when none runs, it has ended, or they do not fit."""
        sampling = self._sampling
        if sampling is None or any(isinstance(s.inputs, BaseException) or not s.prepared for s in batch):
            return False
        return sampling.join(batch)

    def seats(self) -> OpenSeat | None:
        """The room of the batch on the device: jobs of its model and size it takes now."""
        sampling = self._sampling
        return sampling.seats() if sampling is not None else None

    def open_seats(self) -> list[dict[str, Any]]:
        """``seats`` for the heartbeat."""
        seats = self.seats()
        return [seats.telemetry()] if seats is not None else []

    def sampled(self, cohort: list[Started], *, model: str, was_warm: bool) -> SampledBatch:
        """Members that left their batch: observed, traced, and those with latents
        recorded DECODING (under way while they decode)."""
        first = cohort[0]
        BATCH_IMAGES.labels(model=model).observe(first.batch_rows)
        spans.sampled(cohort, seconds=first.sampled_s, rows=first.batch_rows, worker_id=self.worker_id)
        with_latents = [s for s in cohort if isinstance(s.result, torch.Tensor) and not s.watch.discards_work]
        recorded = None
        if with_latents:
            self._warmed_up.add(model)
            recorded = asyncio.ensure_future(self._decoding(with_latents))
        # A run that loaded or warmed up its model says little about how long runs
        # take; nor does one that resumed a job part of the way through.
        whole = all(s.resume is None and s.job.params.first_step() == 0 for s in cohort)
        return SampledBatch(learnable=was_warm and whole, recorded=recorded)

    def member(self, started: Started, loop: asyncio.AbstractEventLoop, batch: BatchProgress) -> BatchMember:
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
            preview_at=job_preview_steps(job),
            on_preview=progress.on_preview,
            on_cached_steps=started.cached,
        )

    async def _decoding(self, sampled: Sequence[Started]) -> None:
        """Records them DECODING, each with when its own sampling began (members that
        joined the batch at one boundary together)."""
        now = datetime.now(UTC)
        by_start: dict[datetime, list[Started]] = {}
        for s in sampled:
            by_start.setdefault(s.sampling_at or now, []).append(s)
        for began_at, group in by_start.items():
            marked = await self.store.decoding([s.job for s in group], now, began_at)
            for s in group:
                if s.job.id in marked:
                    s.decoding_at = now

    # -- decode and finish -----------------------------------------------------------

    async def finish(self, batch: Sequence[Started], sampled: SampledBatch) -> list[Outcome]:
        """Takes members that left their batch together to their stored outcomes, per
        job in order: decoded (in one call) and SUCCEEDED, or failed, cancelled,
        handed back or suspended as each one's result says. Their run time is
        learned once, from the first, under the images it ran beside."""
        latents = [(s.job, s.result) for s in batch if isinstance(s.result, torch.Tensor) and not s.watch.discards_work]
        decoded = await self.decoders.decode_many(latents) if latents else {}
        decoded_at = datetime.now(UTC)
        if sampled.recorded is not None:
            await sampled.recorded  # DECODING before SUCCEEDED, in the database and on the stream
        outcomes = []
        for i, started in enumerate(batch):
            images = started.job.params.num_images
            rows = max(started.batch_rows, images)
            # What its result will say, but its images: what its run measured.
            result = Result(
                started.job.id,
                started.job.attempt,
                (),
                decoded_at,
                # Shared by images: a job of two images in a batch of four used half of it;
                # a batch across a group used each of its devices.
                busy_s=started.sampled_s * images / rows * self.engine.devices_for(started.job.params.model),
                run_seconds=started.sampled_s if sampled.learnable and i == 0 else None,
                batch_rows=rows,
                joined_rows=started.joined_rows,
                cached_steps=started.cached_steps,
            )
            outcomes.append(self._finish_one(started, decoded.get(started.job.id), result))
        return list(await asyncio.gather(*outcomes))

    async def _finish_one(self, started: Started, decoded: Decoded, result: Result) -> Outcome:
        try:
            return await self.outcomes.record(started, decoded, result)
        finally:
            started.timer.cancel()
            self.tracker.finished(started.watch)
