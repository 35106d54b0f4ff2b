"""The jobs a worker runs, and why each must stop: for ``Sampler.CancelJob``, the
timeouts, a drain and a superseded worker."""

from __future__ import annotations

import enum
import threading
import time
from collections import deque

# Finished jobs stay known this long, so that a cancel arriving just after says so.
KEEP_FINISHED_S = 60.0


class StopReason(enum.Enum):
    CANCELLED = "cancelled"  # the client asked
    TIMED_OUT = "timed out"  # past its model's hard timeout
    SUPERSEDED = "superseded"  # the job moved on (requeued): nothing to record
    HANDED_BACK = "handed back"  # the worker is draining: back to the queue, no attempt counted


class JobWatch:
    def __init__(self, job_id: str, attempt: int) -> None:
        self.job_id = job_id
        self.attempt = attempt
        # Set from any thread; the denoising loop checks it between steps.
        self.stopping = threading.Event()
        self.stop_reason: StopReason | None = None
        self.finished_at: float | None = None

    def stop(self, reason: StopReason) -> None:
        """Asks the job to stop at its next step; the first reason given wins."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stopping.set()


class JobTracker:
    def __init__(self) -> None:
        self._jobs: dict[str, JobWatch] = {}
        self._running: dict[str, JobWatch] = {}
        self._finished: deque[JobWatch] = deque()  # oldest first

    def open(self, job_id: str, attempt: int) -> JobWatch:
        self._prune()
        watch = JobWatch(job_id, attempt)
        self._jobs[job_id] = self._running[job_id] = watch
        return watch

    def get(self, job_id: str) -> JobWatch | None:
        return self._jobs.get(job_id)

    def running(self) -> list[JobWatch]:
        return list(self._running.values())

    def stop_all(self, reason: StopReason) -> None:
        for watch in self.running():
            watch.stop(reason)

    def finished(self, watch: JobWatch) -> None:
        watch.finished_at = time.monotonic()
        if self._running.get(watch.job_id) is watch:
            del self._running[watch.job_id]
        self._finished.append(watch)

    def _prune(self) -> None:
        expired = time.monotonic() - KEEP_FINISHED_S
        while self._finished and (self._finished[0].finished_at or 0.0) < expired:
            watch = self._finished.popleft()
            if self._jobs.get(watch.job_id) is watch:
                del self._jobs[watch.job_id]
