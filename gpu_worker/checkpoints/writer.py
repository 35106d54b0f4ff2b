"""Periodic checkpoints of one running job, stored as the sampler hands them over.

The sampling thread captures a checkpoint between steps and goes on at once; the
write happens on the event loop. Only the latest checkpoint matters, so while one
write is under way a newer checkpoint replaces any that waits: a slow database
costs skipped checkpoints, never a growing queue or a stalled GPU."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.metrics import CHECKPOINTS
from services.errors import StoreError
from services.telemetry import logs

log = logging.getLogger(__name__)


class PeriodicCheckpointWriter:
    def __init__(
        self,
        job_id: str,
        attempt: int,
        save: Callable[[Checkpoint], Awaitable[bool]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self._save = save
        self._loop = loop
        self._waiting: Checkpoint | None = None
        self._writing: asyncio.Task[None] | None = None
        self.saved_step = 0  # the latest step stored

    def offer(self, checkpoint: Checkpoint) -> None:
        """From the sampling thread."""
        self._loop.call_soon_threadsafe(self._take, checkpoint)

    def _take(self, checkpoint: Checkpoint) -> None:
        self._waiting = checkpoint
        if self._writing is None:
            self._writing = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while self._waiting is not None:
                checkpoint, self._waiting = self._waiting, None
                try:
                    stored = await self._save(checkpoint)
                except StoreError as exc:
                    log.warning(
                        "checkpoint of %s at step %d not stored: %s",
                        self.job_id,
                        checkpoint.step,
                        exc,
                        extra=logs.job_fields(self.job_id, self.attempt),
                    )
                    continue
                if stored:
                    self.saved_step = checkpoint.step
                    CHECKPOINTS.labels(kind="periodic").inc()
        finally:
            self._writing = None

    async def settled(self) -> None:
        """Waits for the write under way, if any."""
        if self._writing is not None:
            await asyncio.shield(self._writing)
