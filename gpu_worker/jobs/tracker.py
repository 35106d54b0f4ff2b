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
    # Checkpointed at the next step and back to the queue, no attempt counted: the
    # worker is draining, or the scheduler wants the GPU for other work.
    SUSPENDED = "suspended"
    PREEMPTED = "preempted"

    @property
    def keeps_work(self) -> bool:
        """A job stopped for this reason keeps what it has done: suspended at a
        step, or finished if its sampling was done already."""
        return self in (StopReason.SUSPENDED, StopReason.PREEMPTED)


class JobWatch:
    def __init__(self, job_id: str, attempt: int) -> None:
        self.job_id = job_id
        self.attempt = attempt
        # Set from any thread; the denoising loop checks it between steps.
        self.stopping = threading.Event()
        self.stop_reason: StopReason | None = None
        self.finished_at: float | None = None
        # Its latents are out: a suspension has nothing left to save.
        self.sampled = False
        self.detail = ""  # why, in words, for the job's record (whom a preemption makes room for)

    def stop(self, reason: StopReason, detail: str = "") -> None:
        """Asks the job to stop at its next step; the first reason given wins."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.detail = detail
        self.stopping.set()

    @property
    def suspending(self) -> bool:
        """It is asked to stop keeping what it has done (see ``StopReason.keeps_work``)."""
        return self.stop_reason is not None and self.stop_reason.keeps_work

    @property
    def discards_work(self) -> bool:
        """It was stopped, and what it did is not to be used: cancelled, timed out,
        superseded or handed back, but not suspended."""
        return self.stopping.is_set() and not self.suspending


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

    def suspend_sampling(self, reason: StopReason, detail: str = "") -> int:
        """Suspends, at their next step, the jobs still sampling (those already
        decoding finish); returns how many."""
        sampling = [w for w in self.running() if not w.sampled]
        for watch in sampling:
            watch.stop(reason, detail)
        return len(sampling)

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
