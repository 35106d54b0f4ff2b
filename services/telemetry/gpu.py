"""GPU telemetry from NVML: temperature, memory, utilisation, power, SM clock and
throttle reasons by name. Each field is read on its own, so a query a card does
not support loses that field only. Without NVML (no library, no driver, a CPU
worker) the reading says so in ``source``, and the worker says so once."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

# NVML's clock-event (throttle) reason bits, by the names operators know. GPU idle
# is left out: an idle GPU is not throttled.
THROTTLE_REASONS = {
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake",
    0x100: "display_clocks_setting",
}


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_REASONS.items() if mask & bit)


def cuda_uuid(cuda_index: int) -> str:
    """The NVML UUID of a CUDA device. NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES
    (which ``darkroom up`` sets for each sampler), so a CUDA index is no NVML index."""
    import torch

    uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _clock_event_reasons(nvml: Any, handle: Any) -> int:
    # Newer bindings renamed throttle reasons to clock-event reasons.
    query = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return int((query or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)(handle))


@dataclass(frozen=True)
class GpuReading:
    name: str = "cpu"
    source: str = "none"  # "nvml", or "none" with ``unavailable`` saying why
    unavailable: str = ""
    temperature_c: float = 0.0
    vram_total_bytes: int = 0
    vram_used_bytes: int = 0
    utilization_pct: float = 0.0
    memory_utilization_pct: float = 0.0
    power_w: float = 0.0
    power_limit_w: float = 0.0
    sm_clock_mhz: int = 0
    max_sm_clock_mhz: int = 0
    throttle_reasons: tuple[str, ...] = ()
    # Fields NVML did not give (not supported on this card, a transient error):
    # their values above are defaults, not measurements.
    missing: tuple[str, ...] = ()

    @property
    def throttled(self) -> bool:
        return bool(self.throttle_reasons)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "throttle_reasons": list(self.throttle_reasons),
            "missing": list(self.missing),
            "throttled": self.throttled,
        }


class Telemetry:
    def __init__(self, cuda_index: int | None) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        self._unavailable = "a CPU worker" if cuda_index is None else ""
        if cuda_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(cuda_uuid(cuda_index))
                self._nvml = pynvml
            except Exception as exc:  # no library, no driver, no such device
                self._unavailable = f"NVML unavailable: {exc}"
                log.warning("no GPU telemetry: %s", self._unavailable)

    def read(self) -> GpuReading:
        """The current reading; cheap, and safe to call from any thread."""
        if self._handle is None:
            return GpuReading(unavailable=self._unavailable)
        nvml, h = self._nvml, self._handle
        values: dict[str, Any] = {"source": "nvml"}
        missing: list[str] = []

        def field(key: str, query: Any) -> None:
            try:
                values[key] = query()
            except Exception as exc:  # NotSupported on this card, or a transient error
                log.debug("NVML %s: %s", key, exc)
                missing.append(key)

        field("name", lambda: str(nvml.nvmlDeviceGetName(h)))
        field("temperature_c", lambda: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)))
        field("vram_total_bytes", lambda: int(nvml.nvmlDeviceGetMemoryInfo(h).total))
        field("vram_used_bytes", lambda: int(nvml.nvmlDeviceGetMemoryInfo(h).used))
        field("utilization_pct", lambda: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu))
        field("memory_utilization_pct", lambda: float(nvml.nvmlDeviceGetUtilizationRates(h).memory))
        field("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
        field("power_limit_w", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
        field("sm_clock_mhz", lambda: int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)))
        field("max_sm_clock_mhz", lambda: int(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)))
        field("throttle_reasons", lambda: throttle_names(_clock_event_reasons(nvml, h)))
        return GpuReading(**values, missing=tuple(missing))
