"""A running job's denoising steps, handed from the sampling thread to the event loop:
every step goes out as a job event, and to the database at most every
``PROGRESS_WRITE_EVERY_S``; what the write learns back is acted on at once (a
cancel or a suspension asked for, or the attempt superseded)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from gpu_worker.job_store import JobStore
from gpu_worker.metrics import RESUMED_STEPS
from gpu_worker.previews import previews
from gpu_worker.tracker import JobWatch, StopReason
from services.bus.events import Events, JobEvent
from services.db.records import JobRecord
from services.db.repository import Standing
from services.models.registry import ModelFamily

# The cancel and suspend flags come back with each write.
PROGRESS_WRITE_EVERY_S = 0.25

# What a progress write may learn, and the stop it calls for.
_STOPS = {
    Standing.CANCEL_REQUESTED: (StopReason.CANCELLED, ""),
    # The scheduler's call to this worker did not arrive; its flag did.
    Standing.SUSPEND_REQUESTED: (StopReason.PREEMPTED, "preempted for waiting work"),
    Standing.SUPERSEDED: (StopReason.SUPERSEDED, ""),
}


@dataclass(eq=False)
class StepProgress:
    job: JobRecord
    watch: JobWatch
    store: JobStore
    events: Events
    loop: asyncio.AbstractEventLoop
    resumed_from: int = 0  # the checkpoint's step, until the first step says if it was taken
    family: ModelFamily = ModelFamily.SD15  # whose latent space its previews read
    _last_write: float = field(default_factory=time.monotonic, init=False)

    def on_step(self, step: int, total: int) -> None:
        """From the sampling thread, after each step."""
        if self.resumed_from:
            # Its first step says whether the engine took the checkpoint (or,
            # finding it unusable, started over).
            if step == self.resumed_from + 1:
                RESUMED_STEPS.inc(self.resumed_from)
            self.resumed_from = 0
        # The last step's progress is written with the DECODING that follows it.
        write = step < total and time.monotonic() - self._last_write >= PROGRESS_WRITE_EVERY_S
        if write:
            self._last_write = time.monotonic()
        asyncio.run_coroutine_threadsafe(self._report(step, total, write), self.loop)

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
        asyncio.run_coroutine_threadsafe(self.events.job(*events), self.loop)

    async def _report(self, step: int, total: int, write: bool) -> None:
        await self.events.job(JobEvent(self.job.id, self.job.attempt, step=step, total=total))
        if not write:
            return
        standing = await self.store.progress(self.job, step, total)
        stop = _STOPS.get(standing) if standing is not None else None
        if stop is not None:
            self.watch.stop(*stop)
