"""What the worker knows of the jobs it holds, for ``Sampler.WatchJob`` streams and
``Sampler.CancelJob``: an append-only event log per job, and why it must stop."""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import AsyncIterator

from services.rpc.gen.darkroom.internal.v1 import sampler_pb2

# Finished jobs stay watchable this long, for a watcher that arrives just after.
KEEP_FINISHED_S = 60.0


class StopReason(enum.Enum):
    CANCELLED = "cancelled"  # the client asked
    TIMED_OUT = "timed out"  # past its model's hard timeout
    SUPERSEDED = "superseded"  # the job moved on (requeued): nothing to record
    HANDED_BACK = "handed back"  # the worker is draining: back to the queue, no attempt counted


class JobWatch:
    def __init__(self, job_id: str, attempt: int, loop: asyncio.AbstractEventLoop) -> None:
        self.job_id = job_id
        self.attempt = attempt
        # Set from any thread; the denoising loop checks it between steps.
        self.stopping = threading.Event()
        self.stop_reason: StopReason | None = None
        self.events: list[sampler_pb2.SamplerEvent] = []
        self.finished_at: float | None = None
        self._changed = asyncio.Condition()
        self._loop = loop

    def stop(self, reason: StopReason) -> None:
        """Asks the job to stop at its next step; the first reason given wins."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stopping.set()

    async def emit(self, event: sampler_pb2.SamplerEvent) -> None:
        event.job_id = self.job_id
        event.attempt = self.attempt
        async with self._changed:
            self.events.append(event)
            if event.WhichOneof("event") == "finished":
                self.finished_at = time.monotonic()
            self._changed.notify_all()

    def emit_threadsafe(self, event: sampler_pb2.SamplerEvent) -> None:
        """From the sampling thread."""
        asyncio.run_coroutine_threadsafe(self.emit(event), self._loop)

    async def follow(self) -> AsyncIterator[sampler_pb2.SamplerEvent]:
        sent = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda n=sent: len(self.events) > n)  # type: ignore[misc]
                batch = self.events[sent:]
            for event in batch:
                yield event
                sent += 1
                if event.WhichOneof("event") == "finished":
                    return


class JobTracker:
    def __init__(self) -> None:
        self._jobs: dict[str, JobWatch] = {}

    def open(self, job_id: str, attempt: int) -> JobWatch:
        self._prune()
        watch = JobWatch(job_id, attempt, asyncio.get_running_loop())
        self._jobs[job_id] = watch
        return watch

    def get(self, job_id: str) -> JobWatch | None:
        return self._jobs.get(job_id)

    def running(self) -> list[JobWatch]:
        return [w for w in self._jobs.values() if w.finished_at is None]

    def stop_all(self, reason: StopReason) -> None:
        for watch in self.running():
            watch.stop(reason)

    def _prune(self) -> None:
        now = time.monotonic()
        for job_id, watch in list(self._jobs.items()):
            if watch.finished_at is not None and now - watch.finished_at > KEEP_FINISHED_S:
                del self._jobs[job_id]
