"""What a sampler's heartbeat says (``services.presence`` sends it): its GPU's
telemetry, the models it can run and those it holds, measured, and its jobs in flight."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.engine import SamplerEngine
from gpu_worker.metrics import WORKER_INFLIGHT
from gpu_worker.tracker import JobTracker
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import WorkerHeartbeat
from services.telemetry.gpu import Telemetry
from services.telemetry.metrics import observe_gpu


@dataclass(frozen=True)
class SamplerHeartbeat:
    worker_id: str
    address: str
    engine: SamplerEngine
    telemetry: Telemetry
    tracker: JobTracker
    restarts: int

    def __call__(self, status: WorkerStatus) -> WorkerHeartbeat:
        reading = self.telemetry.read()
        inflight = len(self.tracker.running())
        observe_gpu(self.worker_id, reading)
        WORKER_INFLIGHT.labels(worker=self.worker_id).set(inflight)
        return WorkerHeartbeat(
            id=self.worker_id,
            kind=WorkerKind.SAMPLER,
            address=self.address,
            device=reading.name if reading.source == "nvml" else str(self.engine.device),
            models=tuple(self.engine.registry.names()),
            warm_models=tuple(self.engine.warm_models()),
            vram_total_bytes=reading.vram_total_bytes,
            vram_used_bytes=reading.vram_used_bytes,
            temperature_c=reading.temperature_c,
            status=status,
            restarts=self.restarts,
            telemetry={
                **reading.as_dict(),
                "inflight": inflight,
                # Measured, for the scheduler's costs: bytes and load seconds per model.
                "models": self.engine.footprints(),
            },
        )
