"""Simulated fleets for the scheduler's tests, written once: scenarios as plain data
(the keys of ``scheduler/simulator/default_scenario.toml``), an image and a video
model with their job types to start from, and a writer that turns them into the
scenario files the simulator loads."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scheduler.simulator import scenario as scenarios

IMAGE = {"capability": "image", "step_s_512": 0.05, "load_s": 5, "vram_gb": 10}
VIDEO = {"capability": "video", "step_s_512": 1.0, "load_s": 8, "vram_gb": 20}
MODELS = {"img": IMAGE, "vid": VIDEO}
JOBS = {
    "img": {"model": "img", "width": 512, "height": 512, "steps": 20},
    "vid": {"model": "vid", "width": 512, "height": 512, "steps": 30},
}
LANES = {"paid": {"priority": 10}, "free": {"priority": 0}}
# Under what a test's own [darkroom] table says: no latency classes, and preemption
# only by the lists a test gives (the shipped defaults, DARKROOM_BEST_EFFORT=video
# and DARKROOM_PREEMPT_FOR_TARGETS=true, are the default scenario's business).
BY_PRIORITY = {"best_effort": [], "preemption": {"for_targets": False}}


def gpu(gpu_id: str, speed: float, vram_gb: float, *pinned: str) -> dict[str, Any]:
    return {"id": gpu_id, "speed": speed, "vram_gb": vram_gb, "pinned": list(pinned)}


def scenario(**tables: Any) -> dict[str, Any]:
    """A scenario of the image and video models and job types, unless ``tables``
    give others; its [darkroom] table over BY_PRIORITY; every other table as given."""
    return {"models": MODELS, "jobs": JOBS, **tables, "darkroom": changed(BY_PRIORITY, **tables.get("darkroom", {}))}


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def _table(name: str, table: Mapping[str, Any], out: list[str]) -> None:
    """``table`` at ``name``: its plain keys, then its sub-tables (a value that is a
    mapping of mappings) and arrays of tables."""
    out.append(f"[{name}]")
    later = []
    for key, value in table.items():
        if isinstance(value, Mapping) and value and all(isinstance(v, Mapping) for v in value.values()):
            later.append((key, value))
        else:
            out.append(f"{key} = {_value(value)}")
    for key, value in later:
        for sub, inner in value.items():
            _table(f"{name}.{key}.{sub}", inner, out)


def toml(data: Mapping[str, Any]) -> str:
    out: list[str] = []
    for key, value in data.items():
        if isinstance(value, list):
            for item in value:
                out += [f"[[{key}]]", *(f"{k} = {_value(v)}" for k, v in item.items())]
        elif key in ("models", "jobs"):
            for name, table in value.items():
                _table(f"{key}.{name}", table, out)
        else:
            _table(key, value, out)
    return "\n".join(out) + "\n"


def write(path: Path, data: Mapping[str, Any]) -> Path:
    path.write_text(toml(data))
    return path


def load(tmp_path: Path, data: Mapping[str, Any], name: str = "scenario") -> scenarios.Scenario:
    return scenarios.load(write(tmp_path / f"{name}.toml", data))


def changed(data: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """``data`` with ``changes`` merged in, table by table (a list replaces a list)."""
    merged = dict(data)
    for key, value in changes.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = changed(old, **value)
        else:
            merged[key] = value
    return merged
