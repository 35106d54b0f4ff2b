"""Settings for every Darkroom service, read from ``DARKROOM_*`` variables in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

ENV_PREFIX = "DARKROOM_"


class SettingsError(ValueError):
    """A ``DARKROOM_*`` variable holds a value that cannot be used."""


def _default_data_dir() -> Path:
    return Path(os.path.expanduser("~/.darkroom"))


@dataclass(frozen=True)
class Settings:
    # Where the embedded stack keeps Postgres, JetStream and built models.
    data_dir: Path = field(default_factory=_default_data_dir)
    database_url: str = ""
    nats_url: str = ""
    # A TOML model registry; empty means the one shipped with Darkroom.
    model_registry: str = ""

    gateway_host: str = "127.0.0.1"
    gateway_port: int = 50051
    # Comma-separated keys; empty disables authentication (a local stack).
    api_keys: tuple[str, ...] = ()

    worker_id: str = ""
    worker_host: str = "127.0.0.1"
    worker_port: int = 0
    # "cuda", "cuda:0", "cpu" or empty for "cuda if available, else cpu".
    device: str = ""
    # Models a worker loads at start, before it reports itself ready.
    preload_models: tuple[str, ...] = ()
    vae_host: str = "127.0.0.1"
    vae_port: int = 0

    heartbeat_interval_s: float = 1.0
    # A worker whose last heartbeat is older than this is not given work.
    worker_stale_after_s: float = 10.0
    scheduler_interval_s: float = 0.05
    scheduler_batch: int = 64
    # Jobs a worker may hold beyond the one it is running (late binding).
    worker_backlog: int = 2
    # A SCHEDULED job that has not started after this long is published again
    # (same message id: JetStream drops it if the first publish got through).
    redispatch_after_s: float = 15.0
    # Priority lanes, "name:priority:max_wait_s" each; higher priority runs first,
    # and a submit whose estimated wait passes max_wait_s is refused (backpressure).
    lanes: tuple[str, ...] = ("paid:10:120", "free:0:300")
    # Priority a waiting job gains per second, so that no lane starves.
    lane_aging_per_s: float = 0.5
    # "capability:gpus" each: at most that many GPUs hold such work while other work waits.
    capability_caps: tuple[str, ...] = ()
    # A GPU's queued work counts more above this temperature (twice at +10 C).
    hot_temperature_c: float = 70.0
    # The warm-set planner: how often it runs, and how much history it weighs.
    plan_interval_s: float = 15.0
    demand_window_s: float = 120.0
    # How often the scheduler rereads learned durations and speeds.
    estimates_refresh_s: float = 2.0
    max_prompt_chars: int = 2000
    shutdown_grace_s: float = 10.0
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _parse(f.name, f.type, raw)
        return replace(cls(**values), **overrides)

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce these settings in a child process."""
        env: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            env[ENV_PREFIX + f.name.upper()] = ",".join(value) if isinstance(value, tuple) else str(value)
        return env

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"


def _parse(name: str, type_name: Any, raw: str) -> Any:
    type_name = str(type_name)
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "Path":
            return Path(raw).expanduser()
        if type_name.startswith("tuple"):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
    except ValueError as exc:
        raise SettingsError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {exc}") from exc
    return raw
