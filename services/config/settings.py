"""Settings for every Darkroom service, read from ``DARKROOM_*`` variables in one
place: parsed, range-checked, and failing fast with the variable's name."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

ENV_PREFIX = "DARKROOM_"
LOG_FORMATS = ("json", "text")


class SettingsError(ValueError):
    """A ``DARKROOM_*`` variable holds a value that cannot be used."""


def _default_data_dir() -> Path:
    return Path(os.path.expanduser("~/.darkroom"))


def _at_least(low: float, default: Any) -> Any:
    return field(default=default, metadata={"min": low})


def _between(low: float, high: float, default: Any) -> Any:
    return field(default=default, metadata={"min": low, "max": high})


@dataclass(frozen=True)
class Settings:
    # Where the embedded stack keeps Postgres, JetStream and built models.
    data_dir: Path = field(default_factory=_default_data_dir)
    database_url: str = ""
    # One URL, or several comma-separated: every node of a NATS cluster.
    nats_url: str = ""
    # Copies JetStream keeps of the dispatch stream: 3 on a three-node cluster.
    nats_replicas: int = _at_least(1, 1)
    # A TOML model registry; empty means the one shipped with Darkroom.
    model_registry: str = ""

    gateway_host: str = "127.0.0.1"
    gateway_port: int = _at_least(0, 50051)
    # Comma-separated keys; empty disables authentication (a local stack).
    api_keys: tuple[str, ...] = ()

    # The scheduler serves gRPC health checking here.
    scheduler_host: str = "127.0.0.1"
    scheduler_port: int = _at_least(0, 0)

    # Prometheus: a service serves /metrics on this port, from a thread; 0 serves
    # none. Under ``darkroom up`` and ``darkroom supervise`` it is the first of
    # consecutive ports, one per child (0: a free port each), so that several
    # samplers on one host never share one; they list them in
    # DATA_DIR/prometheus/targets.json. 0.0.0.0 lets another host scrape.
    metrics_host: str = "127.0.0.1"
    metrics_port: int = _at_least(0, 0)

    # Empty: host and GPU (a restarted sampler takes back its own subject).
    worker_id: str = ""
    worker_host: str = "127.0.0.1"
    worker_port: int = _at_least(0, 0)
    # "cuda", "cuda:0", "cpu" or empty for "cuda if available, else cpu".
    device: str = ""
    # Models pinned to a worker: loaded at start, and warmed up with one real
    # generation, before it reports itself ready; evicted last.
    preload_models: tuple[str, ...] = ()
    # Memory a sampler's models may take (MiB); 0: the GPU's own, unlimited on a CPU.
    memory_budget_mb: int = _at_least(0, 0)
    # How long a sampler holding a partial batch waits for more jobs of its shape;
    # it always waits for the jobs the same scheduling pass sent it (published
    # together), so 0 batches what was queued together and delays nothing else.
    batch_wait_ms: float = _at_least(0.0, 0.0)
    # Bytes of prompt embeddings a sampler keeps (MiB).
    prompt_cache_mb: int = _at_least(0, 64)
    vae_host: str = "127.0.0.1"
    vae_port: int = _at_least(0, 0)
    # A sampler decodes its own latents when no decoder service can.
    local_decode_fallback: bool = False
    # A decoder gathers concurrent requests of one model and latent shape for this
    # long (a sampler's batch is one request; under load requests gather anyway while
    # the previous batch runs), into one VAE call of at most this many images.
    decode_batch_wait_ms: float = _at_least(0.0, 0.0)
    decode_max_batch: int = _at_least(1, 8)
    # Images of more pixels than this decode in overlapping tiles, so that a
    # decoder's memory stays that of a tile.
    decode_tile_above_pixels: int = _at_least(1, 1536 * 1536)
    # Decoded images whose pixels (0..1) vary less than this (standard deviation)
    # are degenerate: the decode fails, for another decoder to try.
    decode_min_pixel_std: float = _at_least(0.0, 0.002)

    heartbeat_interval_s: float = _at_least(0.05, 1.0)
    # A worker whose last heartbeat is older than this is given no work, and the
    # jobs it holds go back to the queue.
    worker_stale_after_s: float = _at_least(0.5, 10.0)
    # A worker silent this long, holding nothing, is forgotten: its registry row,
    # its JetStream consumer and any messages left on its subject.
    worker_forget_after_s: float = _at_least(1.0, 3600.0)
    scheduler_interval_s: float = _at_least(0.001, 0.05)
    scheduler_batch: int = _at_least(1, 64)
    # How often the scheduler looks for stalled, expired and exhausted jobs.
    recovery_interval_s: float = _at_least(0.05, 1.0)
    # A job whose attempts have failed this many times is FAILED.
    max_attempts: int = _at_least(1, 3)
    # Jobs a worker may hold beyond the one it is running (late binding).
    worker_backlog: int = _at_least(0, 2)
    # A SCHEDULED job that has not started after this long is published again
    # (same message id: JetStream drops it if the first publish got through).
    redispatch_after_s: float = _at_least(0.1, 15.0)
    # JetStream redelivers a dispatch not acked (or kept in progress) this long.
    dispatch_ack_wait_s: float = _at_least(1.0, 30.0)
    # Dispatches a worker may hold unacked.
    dispatch_max_ack_pending: int = _at_least(1, 64)
    # How long a worker retries storing a job's outcome before it leaves the
    # dispatch unacked, for redelivery, and moves on.
    outcome_retry_s: float = _at_least(0.0, 30.0)
    # Consecutive failed attempts after which a sampler reports itself unhealthy
    # and exits, for its supervisor to restart it.
    unhealthy_after_failures: int = _at_least(1, 3)
    # Priority lanes, "name:priority:max_wait_s[:target_s]" each; higher priority
    # runs first, a submit whose estimated wait passes max_wait_s is refused
    # (backpressure), and a lane with a latency target (seconds, submit to done)
    # is latency-bound: its work goes before best-effort work, earliest deadline first.
    lanes: tuple[str, ...] = ("paid:10:120", "free:0:300")
    # Capabilities or lanes whose work is best effort whatever its lane's target
    # (video, batch work): it takes the GPUs latency-bound work does not need.
    best_effort: tuple[str, ...] = ()
    # "capability:target_s" each: a latency target tighter than the lane's.
    capability_targets: tuple[str, ...] = ()
    # The warm-set plan sizes latency-bound work's GPUs for this multiple of its
    # forecast demand (room for bursts).
    latency_headroom: float = _at_least(1.0, 1.3)
    # Priority a waiting job gains per second, so that no lane starves.
    lane_aging_per_s: float = _at_least(0.0, 0.5)
    # "capability:gpus" each: at most that many GPUs hold such work while other work waits.
    capability_caps: tuple[str, ...] = ()
    # Preemption: running jobs of these lanes or capabilities may be suspended at a
    # step (checkpointed, back to the queue, no attempt counted) for waiting jobs of
    # the preempting lanes. Empty: nothing is ever preempted.
    preemptible: tuple[str, ...] = ()
    preempting_lanes: tuple[str, ...] = ()
    # A job is never preempted more often than this.
    max_preemptions: int = _at_least(0, 2)
    # A waiting job preempts only when it would otherwise wait longer than this.
    preempt_after_s: float = _at_least(0.0, 2.0)
    # Latency classes decide preemption too: a job with a target it would miss may
    # suspend best-effort work (a job with no target).
    preempt_for_targets: bool = False
    # ... when its estimated finish passes this share of its target (the estimate
    # is a mean, the target a p99).
    preempt_target_share: float = _between(0.01, 1.0, 0.3)
    # A GPU's queued work counts more above this temperature (twice at +10 C).
    hot_temperature_c: float = 70.0
    # The warm-set planner: how often it runs, and how much history it weighs.
    plan_interval_s: float = _at_least(0.1, 15.0)
    demand_window_s: float = _at_least(1.0, 120.0)
    # How often the scheduler rereads learned durations and speeds.
    estimates_refresh_s: float = _at_least(0.0, 2.0)
    max_prompt_chars: int = _at_least(1, 2000)
    # How long a stopping service may take to finish what it is doing.
    shutdown_grace_s: float = _at_least(0.0, 10.0)

    # Supervision (``darkroom up``, ``darkroom supervise``): a child that has not
    # shown it is alive for this long is hung, and is killed and restarted.
    hang_after_s: float = _at_least(1.0, 15.0)
    # Restart delays: doubling from the first to the longest.
    restart_backoff_s: float = _at_least(0.0, 0.5)
    restart_backoff_max_s: float = _at_least(0.0, 30.0)
    # Set by the supervisor for its children: the file a child touches to show it
    # is alive, and how many times the child has been restarted.
    liveness_file: str = ""
    restarts: int = _at_least(0, 0)
    log_level: str = "INFO"
    # "json": one object per line, with job_id and attempt on every line about a
    # job; "text": the same as key=value after the message.
    log_format: str = "json"

    # Traces (``services.telemetry.tracing``): an OpenTelemetry collector's OTLP/gRPC address,
    # "http://host:4317" (plaintext) or "https://host:4317" (TLS); empty: no traces.
    otlp_endpoint: str = ""
    # The share of jobs traced, decided at submit: every service follows the gateway.
    trace_sample_ratio: float = _between(0.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            low, high = f.metadata.get("min"), f.metadata.get("max")
            value = getattr(self, f.name)
            if low is not None and not (isinstance(value, int | float) and math.isfinite(value) and value >= low):
                raise SettingsError(f"{ENV_PREFIX}{f.name.upper()}={value!r}: must be a number of at least {low}")
            if high is not None and value > high:
                raise SettingsError(f"{ENV_PREFIX}{f.name.upper()}={value!r}: must be at most {high}")
        if self.log_format not in LOG_FORMATS:
            raise SettingsError(f"{ENV_PREFIX}LOG_FORMAT={self.log_format!r}: must be one of {', '.join(LOG_FORMATS)}")
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise SettingsError(
                f"{ENV_PREFIX}OTLP_ENDPOINT={self.otlp_endpoint!r}: must start with http:// (plaintext) or https://"
            )

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
            if isinstance(value, tuple):
                env[ENV_PREFIX + f.name.upper()] = ",".join(value)
            elif isinstance(value, bool):
                env[ENV_PREFIX + f.name.upper()] = "true" if value else "false"
            else:
                env[ENV_PREFIX + f.name.upper()] = str(value)
        return env

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def nats_servers(self) -> list[str]:
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse(name: str, type_name: Any, raw: str) -> Any:
    type_name = str(type_name)
    variable = f"{ENV_PREFIX}{name.upper()}={raw!r}"
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "bool":
            if raw.strip().lower() not in _TRUE | _FALSE:
                raise ValueError("expected true or false")
            return raw.strip().lower() in _TRUE
        if type_name == "Path":
            return Path(raw).expanduser()
        if type_name.startswith("tuple"):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
    except ValueError as exc:
        raise SettingsError(f"{variable}: {exc}") from exc
    return raw
