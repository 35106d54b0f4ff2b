"""NVML telemetry, with a stand-in for the NVML library (hardware this machine lacks)."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from services.telemetry import gpu as telemetry
from services.telemetry.gpu import Telemetry, throttle_names


class NotSupported(Exception):
    pass


def fake_nvml(*, unsupported: frozenset[str] = frozenset(), init_error: str = "") -> types.ModuleType:
    nvml: Any = types.ModuleType("pynvml")
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.NVML_CLOCK_SM = 1

    def call(name: str, value: Any) -> Any:
        def query(*args: Any) -> Any:
            if name in unsupported:
                raise NotSupported(name)
            return value

        return query

    def init() -> None:
        if init_error:
            raise RuntimeError(init_error)

    nvml.nvmlInit = init
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: f"handle of {uuid}"
    nvml.nvmlDeviceGetName = call("name", "NVIDIA H100 80GB HBM3")
    nvml.nvmlDeviceGetTemperature = call("temperature", 71)
    nvml.nvmlDeviceGetMemoryInfo = call("memory", types.SimpleNamespace(total=80 * 2**30, used=12 * 2**30))
    nvml.nvmlDeviceGetUtilizationRates = call("utilization", types.SimpleNamespace(gpu=97, memory=41))
    nvml.nvmlDeviceGetPowerUsage = call("power", 612_000)
    nvml.nvmlDeviceGetEnforcedPowerLimit = call("power_limit", 700_000)
    nvml.nvmlDeviceGetClockInfo = call("clock", 1755)
    nvml.nvmlDeviceGetMaxClockInfo = call("max_clock", 1980)
    # GPU idle (0x1) is not a throttle; SW power cap (0x4) and HW thermal (0x40) are.
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = call("throttle", 0x1 | 0x4 | 0x40)
    return nvml


@pytest.fixture
def nvml_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # NVML finds the GPU by the UUID CUDA gives it (there is no CUDA here either).
    monkeypatch.setattr(telemetry, "cuda_uuid", lambda index: f"GPU-{index}")

    def install(module: types.ModuleType | None) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", module)  # type: ignore[arg-type]

    yield install


def test_every_field_is_read(nvml_module: Any) -> None:
    nvml_module(fake_nvml())
    reading = Telemetry(0).read()
    assert reading.source == "nvml" and reading.unavailable == "" and reading.missing == ()
    assert reading.name == "NVIDIA H100 80GB HBM3"
    assert (reading.temperature_c, reading.utilization_pct, reading.memory_utilization_pct) == (71.0, 97.0, 41.0)
    assert (reading.vram_total_bytes, reading.vram_used_bytes) == (80 * 2**30, 12 * 2**30)
    assert (reading.power_w, reading.power_limit_w) == (612.0, 700.0)
    assert (reading.sm_clock_mhz, reading.max_sm_clock_mhz) == (1755, 1980)
    assert reading.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown") and reading.throttled
    assert reading.as_dict()["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]


def test_an_unsupported_query_loses_only_its_field(nvml_module: Any) -> None:
    nvml_module(fake_nvml(unsupported=frozenset({"power", "clock"})))
    reading = Telemetry(0).read()
    assert reading.power_w == 0.0 and reading.sm_clock_mhz == 0
    assert reading.temperature_c == 71.0 and reading.power_limit_w == 700.0 and reading.max_sm_clock_mhz == 1980
    # Said, so that nothing reads the defaults as 0 W and 0 MHz.
    assert reading.missing == ("power_w", "sm_clock_mhz")


def test_the_gpu_is_found_by_its_cuda_uuid(nvml_module: Any) -> None:
    nvml_module(fake_nvml())
    # CUDA device 1 of this process may be any NVML index: the UUID names it.
    assert Telemetry(1)._handle == "handle of GPU-1"


def test_newer_bindings_read_clock_event_reasons(nvml_module: Any) -> None:
    nvml = fake_nvml()
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda handle: 0x8  # type: ignore[attr-defined]
    nvml_module(nvml)
    assert Telemetry(0).read().throttle_reasons == ("hw_slowdown",)


def test_throttle_reasons_by_name() -> None:
    assert throttle_names(0) == ()
    assert throttle_names(0x1) == ()  # idle
    assert throttle_names(0x8 | 0x80 | 0x100) == ("hw_slowdown", "hw_power_brake", "display_clocks_setting")


def test_without_nvml_the_worker_runs_and_says_so_once(nvml_module: Any, caplog: pytest.LogCaptureFixture) -> None:
    nvml_module(fake_nvml(init_error="NVML Shared Library Not Found"))
    with caplog.at_level(logging.WARNING, logger="darkroom.telemetry"):
        telemetry = Telemetry(0)
        readings = [telemetry.read() for _ in range(5)]
    assert len(caplog.records) == 1  # said once, at start, not on every heartbeat
    assert all(r.source == "none" and "Shared Library Not Found" in r.unavailable for r in readings)
    assert readings[0].vram_total_bytes == 0 and not readings[0].throttled


def test_no_library_at_all(nvml_module: Any) -> None:
    nvml_module(None)  # import pynvml raises ImportError
    reading = Telemetry(0).read()
    assert reading.source == "none" and reading.unavailable.startswith("NVML unavailable")


def test_a_cpu_worker_has_no_gpu_to_read() -> None:
    reading = Telemetry(None).read()
    assert (reading.source, reading.unavailable, reading.name) == ("none", "a CPU worker", "cpu")
