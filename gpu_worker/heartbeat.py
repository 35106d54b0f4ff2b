"""The sampler's own part of its heartbeat (``services.presence.Heartbeat`` sends
it with its card's telemetry): its jobs in flight, the models it holds, measured
as they loaded, how busy denoising keeps it, the room in the batch it runs, and (where there is a model store)
the blobs in its host's cache, which other hosts may fetch from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.tracker import JobTracker
from gpu_worker.metrics import WORKER_INFLIGHT
from gpu_worker.models.model_store import CachedBlobs


@dataclass(frozen=True)
class SamplerLoad:
    worker_id: str
    engine: SamplerEngine
    tracker: JobTracker
    cache: CachedBlobs | None = None
    # The room of the batch on the device (``JobRunner.open_seats``): placement may
    # send it jobs of its model and size, to join at its next step boundary.
    open_seats: Callable[[], list[dict[str, Any]]] | None = None

    def __call__(self) -> dict[str, Any]:
        inflight = len(self.tracker.running())
        WORKER_INFLIGHT.labels(worker=self.worker_id).set(inflight)
        # Measured, for the scheduler's costs: bytes and load seconds per model; and
        # whether its GPU waits for the host (``gpu_worker.busy``).
        own = {"inflight": inflight, "models": self.engine.footprints(), **self.engine.busy.reading().telemetry()}
        own.update(self.engine.adapters())  # ``adapters``: resident ones, which placement prefers
        if self.open_seats is not None:
            own["open_seats"] = self.open_seats()
        group = self.engine.group_facts()
        if group is not None:
            own["group"] = group  # one worker of several devices: placement and billing count them
        if self.cache is not None:
            own.update(self.cache.telemetry())  # ``model_cache``: what peers may ask this host for
        return own
