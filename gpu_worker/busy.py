"""How much of the time work waits on a sampler it spends denoising, and the host's
time between one batch's denoising and the next: what says whether the GPU waits
for the host. Work waits from the moment a dispatch is in hand until nothing is in
hand, starting or sampling; denoising is a batch's time in its denoiser (model loads
aside). Fed from the event loop (work) and the sampling thread (batches)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpu_worker.metrics import DENOISE_BUSY_RATIO, DENOISE_SECONDS, HOST_GAP_SECONDS, WORK_WAITING_SECONDS


@dataclass(frozen=True)
class BusyReading:
    denoising_s: float  # in the denoiser
    waiting_s: float  # with work here
    batches: int
    gaps_s: float  # between consecutive batches while work waited

    @property
    def ratio(self) -> float:
        """Denoising over the time work waited; 1.0 before any work."""
        return self.denoising_s / self.waiting_s if self.waiting_s > 0 else 1.0

    def telemetry(self) -> dict[str, float]:
        return {
            "denoise_busy_ratio": round(self.ratio, 6),
            "denoising_seconds": round(self.denoising_s, 6),
            "work_waiting_seconds": round(self.waiting_s, 6),
            "denoised_batches": self.batches,
            "host_gap_seconds": round(self.gaps_s, 6),
        }


class BusyClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._denoising_s = 0.0
        self._waiting_s = 0.0
        self._gaps_s = 0.0
        self._batches = 0
        self._waiting_since: float | None = None
        # When the last batch's denoising ended, while work has waited since.
        self._last_end: float | None = None
        self._denoising_since: float | None = None  # the batch denoising now began

    def work(self, waiting: bool) -> None:
        """Whether work waits here now (the consumer calls it as that may change)."""
        with self._lock:
            now = self._clock()
            if waiting and self._waiting_since is None:
                self._waiting_since = now
                self._last_end = None  # it was idle: the first batch's wait is not a gap between batches
            elif not waiting and self._waiting_since is not None:
                self._add_waiting(now)
                self._waiting_since = None

    @contextlib.contextmanager
    def denoising(self) -> Iterator[None]:
        """Around a batch's denoising (in the sampling thread). One while no work
        waited (a model's warm-up) is not counted."""
        with self._lock:
            began = self._clock()
            counted = self._waiting_since is not None
            if counted:
                self._denoising_since = began
                if self._last_end is not None:
                    gap = max(0.0, began - self._last_end)
                    self._gaps_s += gap
                    HOST_GAP_SECONDS.observe(gap)
        try:
            yield
        finally:
            with self._lock:
                ended = self._clock()
                if counted:
                    self._denoising_since = None
                    self._denoising_s += ended - began
                    DENOISE_SECONDS.inc(ended - began)
                    self._batches += 1
                    self._last_end = ended

    def reading(self) -> BusyReading:
        """The account so far, the batch denoising now and the work waiting now included."""
        with self._lock:
            now = self._clock()
            if self._waiting_since is not None:
                self._add_waiting(now)
            denoising = self._denoising_s
            if self._denoising_since is not None:
                denoising += now - self._denoising_since
            reading = BusyReading(denoising, self._waiting_s, self._batches, self._gaps_s)
        DENOISE_BUSY_RATIO.set(reading.ratio)
        return reading

    def _add_waiting(self, now: float) -> None:
        assert self._waiting_since is not None
        WORK_WAITING_SECONDS.inc(now - self._waiting_since)
        self._waiting_s += now - self._waiting_since
        self._waiting_since = now
