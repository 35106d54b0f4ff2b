"""GPU telemetry from NVML, when there is a GPU; zeros on a CPU worker."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("darkroom.telemetry")


@dataclass(frozen=True)
class GpuReading:
    name: str = "cpu"
    temperature_c: float = 0.0
    vram_total_bytes: int = 0
    vram_used_bytes: int = 0
    utilization_pct: float = 0.0
    power_w: float = 0.0
    throttled: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Telemetry:
    def __init__(self, cuda_index: int | None) -> None:
        self._handle: Any = None
        if cuda_index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
        except Exception as exc:
            log.warning("NVML unavailable, no GPU telemetry: %s", exc)

    def read(self) -> GpuReading:
        if self._handle is None:
            return GpuReading()
        import pynvml

        h = self._handle
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            reasons = pynvml.nvmlClocksThrottleReasonGpuIdle
            throttle = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h) & ~reasons
            return GpuReading(
                name=str(pynvml.nvmlDeviceGetName(h)),
                temperature_c=float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                vram_total_bytes=int(mem.total),
                vram_used_bytes=int(mem.used),
                utilization_pct=float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
                power_w=pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                throttled=bool(throttle),
            )
        except Exception as exc:
            log.warning("NVML read failed: %s", exc)
            return GpuReading()
