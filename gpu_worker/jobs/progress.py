"""A running batch's denoising steps, handed from the sampling thread to the event
loop at the least cost to the sampling thread: a step only records each job's
latest step and, once per round of steps, asks the loop to report. The loop then
publishes each job's latest step as a job event and, at most every
``PROGRESS_WRITE_EVERY_S``, writes the batch's steps to the database in one
statement; what the write learns back is acted on at once (a cancel or a
suspension asked for, or the attempt superseded).

Why so frugal: the sampling thread and the event loop share one interpreter lock,
and every moment the loop spends on reports is a moment the sampling thread may
wait to queue the device's next kernels."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import torch

from gpu_worker.jobs.job_store import JobStore
from gpu_worker.jobs.previews import previews
from gpu_worker.jobs.tracker import JobWatch, StopReason
from gpu_worker.metrics import RESUMED_STEPS
from services.bus.events import Events, JobEvent
from services.db.records import JobRecord
from services.db.repository import Standing, StepReport
from services.models.spec import ModelFamily

# The cancel and suspend flags come back with each write.
PROGRESS_WRITE_EVERY_S = 0.25

# What a progress write may learn, and the stop it calls for.
_STOPS = {
    Standing.CANCEL_REQUESTED: (StopReason.CANCELLED, ""),
    # The scheduler's call to this worker did not arrive; its flag did.
    Standing.SUSPEND_REQUESTED: (StopReason.PREEMPTED, "preempted for waiting work"),
    Standing.SUPERSEDED: (StopReason.SUPERSEDED, ""),
}


class BatchProgress:
    """The progress of one batch's jobs (``member`` makes each job's reporter)."""

    def __init__(self, store: JobStore, events: Events, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.events = events
        self.loop = loop
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[StepProgress, int, int]] = {}  # job id -> (reporter, step, total)
        self._flush_asked = False
        self._last_write = time.monotonic()
        self._writing = False
        self._reporting: set[asyncio.Future[None]] = set()

    def member(
        self, job: JobRecord, watch: JobWatch, *, resumed_from: int = 0, family: ModelFamily = ModelFamily.SD15
    ) -> StepProgress:
        return StepProgress(self, job, watch, resumed_from=resumed_from, family=family)

    def stepped(self, reporter: StepProgress, step: int, total: int) -> None:
        """From the sampling thread: the job's latest step, reported once the loop gets to it."""
        with self._lock:
            self._latest[reporter.job.id] = (reporter, step, total)
            if self._flush_asked:
                return
            self._flush_asked = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            latest, self._latest = self._latest, {}
            self._flush_asked = False
        events = [JobEvent(r.job.id, r.job.attempt, step=step, total=total) for r, step, total in latest.values()]
        # The last step's progress is written with the DECODING that follows it.
        reports = [
            (r, StepReport(r.job.id, r.job.attempt, step, total)) for r, step, total in latest.values() if step < total
        ]
        write = bool(reports) and not self._writing and time.monotonic() - self._last_write >= PROGRESS_WRITE_EVERY_S
        if write:
            self._last_write = time.monotonic()
            self._writing = True
        task = asyncio.ensure_future(self._report(events, reports if write else []))
        self._reporting.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._reporting.discard)

    async def _report(self, events: list[JobEvent], reports: list[tuple[StepProgress, StepReport]]) -> None:
        await self.events.job(*events)
        if not reports:
            return
        try:
            standings = await self.store.progress([report for _, report in reports])
        finally:
            self._writing = False
        asked = [job_id for job_id, standing in standings.items() if standing == Standing.SUSPEND_REQUESTED]
        reasons = await self.store.suspend_reasons(asked) if asked else {}
        for reporter, report in reports:
            stop = _STOPS.get(standings.get(report.job_id, Standing.CURRENT))
            if stop is not None:
                reporter.watch.stop(stop[0], reasons.get(report.job_id) or stop[1])


@dataclass(eq=False)
class StepProgress:
    """One job's reporter in its batch's ``BatchProgress``."""

    batch: BatchProgress
    job: JobRecord
    watch: JobWatch
    resumed_from: int = 0  # the checkpoint's step, until the first step says if it was taken
    family: ModelFamily = ModelFamily.SD15  # whose latent space its previews read

    def on_step(self, step: int, total: int) -> None:
        """From the sampling thread, after each step."""
        if self.resumed_from:
            # Its first step says whether the engine took the checkpoint (or,
            # finding it unusable, started over).
            if step == self.resumed_from + 1:
                RESUMED_STEPS.inc(self.resumed_from)
            self.resumed_from = 0
        self.batch.stepped(self, step, total)

    def on_preview(self, step: int, total: int, latents: torch.Tensor) -> None:
        """From the sampling thread, after a step its job wants previewed: each
        image's preview (made here, off the event loop) goes out as a job event."""
        p = self.job.params
        made = previews(latents, self.family, p.width, p.height)
        events = [
            JobEvent(
                self.job.id, self.job.attempt, step=step, total=total, preview=data, index=i, size=(p.width, p.height)
            )
            for i, data in enumerate(made)
        ]
        asyncio.run_coroutine_threadsafe(self.batch.events.job(*events), self.batch.loop)
