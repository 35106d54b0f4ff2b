"""The Prometheus metrics every service shares (gRPC calls, jobs ended, GPU
telemetry), the buckets all use, and the helpers that serve and list them. Each
service defines its own metrics beside its code (``<service>/metrics.py``).

Each service process serves its own ``/metrics`` (``serve_metrics``); ``darkroom
up`` and ``darkroom supervise`` give each child a port and list them all in a
file-service-discovery file (``write_targets``) that ``infra/prometheus`` reads.
Names carry their base unit (``_seconds``, ``_bytes``, ``_celsius``, ``_ratio``);
labels never name a job: a label value per job would grow without bound."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily

from services.config.sections import KernelSettings
from services.telemetry.gpu import THROTTLE_REASONS, GpuReading

log = logging.getLogger(__name__)

# ``_created`` series double what every counter and histogram costs Prometheus,
# and nothing here reads them.
disable_created_metrics()

# From a cached prompt embedding (a millisecond) to a large model's first
# generation on a cold GPU (minutes).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# A queued job may wait as long as its lane allows (minutes), or an hour in a backlog.
WAIT_BUCKETS = (*LATENCY_BUCKETS[2:], 1200.0, 1800.0, 3600.0)
# Loading a model: a tiny one from the page cache, to SDXL from a network disk.
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Images in one batch: one, up to a model's max_batch.
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

# Label values the callers use, so that dashboards and alerts can rely on them.
OUTCOMES = ("succeeded", "failed", "cancelled", "expired")

# --- every service -------------------------------------------------------------

BUILD_INFO = Info("darkroom_build", "The Darkroom version and which service this process is.")
RPC_REQUESTS = Counter(
    "darkroom_rpc_requests",
    "gRPC calls this server finished, by full method name and final status code name (OK, NOT_FOUND, ...).",
    ["method", "code"],
)
RPC_DURATION = Histogram(
    "darkroom_rpc_duration_seconds",
    "How long this server took over a gRPC call, from its start to its status (a stream: its whole life).",
    ["method"],
    buckets=LATENCY_BUCKETS,
)
# What a job costs the shared parts, per process: divided by the jobs it served,
# the statements and messages a job takes (bench/controlplane.py's per-service table).
DB_STATEMENTS = Counter("darkroom_db_statements", "Statements this process sent to PostgreSQL.")


class BusMessages:
    """``darkroom_bus_messages_total{direction}``: the messages this process's NATS
    connections sent ("out") and received ("in"), as nats.py counts them, read at
    each scrape (counting them again in every publish would cost each one)."""

    def __init__(self) -> None:
        self._connections: list[Any] = []

    def watch(self, connection: Any) -> None:
        """Counts ``connection`` (a ``nats.NATS``, for the life of the process)."""
        self._connections.append(connection)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "darkroom_bus_messages", "Messages this process sent to NATS and received from it.", labels=["direction"]
        )
        for direction in ("in", "out"):
            family.add_metric([direction], sum(c.stats[f"{direction}_msgs"] for c in self._connections))
        yield family


BUS_MESSAGES = BusMessages()
REGISTRY.register(BUS_MESSAGES)
MESH_REFUSALS = Counter(
    "darkroom_mesh_refusals",
    "Internal calls refused by this server for the caller's certificate, by service and reason (role: a "
    "certificate of a role that may not call the method). Handshakes without a certificate of the fleet's CA "
    "end in TLS, before any method, and are in gRPC's own log.",
    ["service", "reason"],
)

# --- the life of a job ----------------------------------------------------------

JOBS_FINISHED = Counter(
    "darkroom_jobs_finished",
    "Jobs that reached a final state, by outcome: succeeded, failed, cancelled or expired.",
    ["outcome"],
)
REQUEUES = Counter(
    "darkroom_requeues",
    "Jobs put back in the queue, by cause (a worker lost, a drain's hand-back, a failed attempt to retry).",
    ["cause"],
)
ATTEMPTS_FAILED = Counter(
    "darkroom_attempts_failed",
    "Attempts that failed (each one counts towards MAX_ATTEMPTS), by cause.",
    ["cause"],
)

# --- GPU telemetry (samplers and decoders), from NVML at each heartbeat ---------------

GPU_TELEMETRY_AVAILABLE = Gauge(
    "darkroom_gpu_telemetry_available",
    "1 when the worker reads its GPU through NVML; 0 (a CPU worker, no driver) and its darkroom_gpu_* are absent.",
    ["worker"],
)
GPU_TEMPERATURE = Gauge("darkroom_gpu_temperature_celsius", "GPU core temperature, as NVML reads it.", ["worker"])
GPU_MEMORY_USED = Gauge("darkroom_gpu_memory_used_bytes", "GPU memory in use, by every process on it.", ["worker"])
GPU_MEMORY_TOTAL = Gauge("darkroom_gpu_memory_total_bytes", "GPU memory installed (NVML's total).", ["worker"])
GPU_UTILIZATION = Gauge(
    "darkroom_gpu_utilization_ratio", "Share of the last sample period a kernel ran on the GPU (0 to 1).", ["worker"]
)
GPU_POWER = Gauge("darkroom_gpu_power_watts", "Power the GPU draws now.", ["worker"])
GPU_POWER_LIMIT = Gauge("darkroom_gpu_power_limit_watts", "The power limit the GPU enforces now.", ["worker"])
GPU_SM_CLOCK = Gauge("darkroom_gpu_sm_clock_hertz", "The GPU's SM (streaming multiprocessor) clock now.", ["worker"])
GPU_SM_CLOCK_MAX = Gauge("darkroom_gpu_sm_clock_max_hertz", "The highest SM clock the GPU can run at.", ["worker"])
GPU_THROTTLED = Gauge(
    "darkroom_gpu_throttled",
    "1 while the GPU's clocks are held down for this reason (NVML clock-event reasons; idle is none).",
    ["worker", "reason"],
)

# The per-worker GPU gauges, by the GpuReading field each is read from, and the
# factor to its base unit.
_GPU_FIELDS: tuple[tuple[Gauge, str, float], ...] = (
    (GPU_TEMPERATURE, "temperature_c", 1.0),
    (GPU_MEMORY_USED, "vram_used_bytes", 1.0),
    (GPU_MEMORY_TOTAL, "vram_total_bytes", 1.0),
    (GPU_UTILIZATION, "utilization_pct", 0.01),
    (GPU_POWER, "power_w", 1.0),
    (GPU_POWER_LIMIT, "power_limit_w", 1.0),
    (GPU_SM_CLOCK, "sm_clock_mhz", 1e6),
    (GPU_SM_CLOCK_MAX, "max_sm_clock_mhz", 1e6),
)


def observe_gpu(worker_id: str, reading: GpuReading) -> None:
    """Sets the worker's GPU gauges from a telemetry reading. A reading without
    NVML (a CPU worker, no driver), or a field NVML would not give, leaves its
    gauges absent rather than claiming 0 C or 0 W."""
    nvml = reading.source == "nvml"
    GPU_TELEMETRY_AVAILABLE.labels(worker=worker_id).set(1 if nvml else 0)
    for gauge, name, scale in _GPU_FIELDS:
        if nvml and name not in reading.missing:
            gauge.labels(worker=worker_id).set(float(getattr(reading, name)) * scale)
        else:
            gauge.remove(worker_id)
    for reason in THROTTLE_REASONS.values():
        if nvml and "throttle_reasons" not in reading.missing:
            GPU_THROTTLED.labels(worker=worker_id, reason=reason).set(1 if reason in reading.throttle_reasons else 0)
        else:
            GPU_THROTTLED.remove(worker_id, reason)


def serve_metrics(settings: KernelSettings, service: str) -> WSGIServer | None:
    """Serves ``/metrics`` on ``settings.metrics_port`` from a thread of its own (0:
    not at all); returns the server, to shut down where the process goes on. A
    port that cannot be had is logged, not fatal: an observer's port is no reason
    to stop serving images (Prometheus shows the target down)."""
    try:
        version = metadata.version("darkroom")
    except metadata.PackageNotFoundError:
        version = "unknown"
    BUILD_INFO.info({"service": service, "version": version})
    if not settings.metrics_port:
        return None
    try:
        server, _ = start_http_server(settings.metrics_port, addr=settings.metrics_host)
    except OSError as exc:
        log.error("cannot serve metrics on %s:%d: %s", settings.metrics_host, settings.metrics_port, exc)
        return None
    log.info("%s metrics on http://%s:%d/metrics", service, settings.metrics_host, settings.metrics_port)
    return server


@dataclass(frozen=True)
class Target:
    """One process for Prometheus to scrape: ``service`` is its kind (gateway,
    scheduler, sampler, decoder), ``child`` its name under its supervisor."""

    child: str
    service: str
    host: str
    address: str

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"


def targets_path(data_dir: Path) -> Path:
    """Where ``darkroom up`` and ``darkroom supervise`` list their children for
    Prometheus (``file_sd_configs`` in ``infra/prometheus/prometheus.yml``)."""
    return data_dir / "prometheus" / "targets.json"


def write_targets(path: Path, targets: Sequence[Target]) -> None:
    """Writes the targets as a Prometheus file-service-discovery file, whole or not
    at all: Prometheus rereads it when it changes and must never see half of it."""
    groups = [
        {"targets": [t.address], "labels": {"service": t.service, "child": t.child, "host": t.host}} for t in targets
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".targets-", suffix=".json")
    try:
        os.fchmod(fd, 0o644)  # for a Prometheus running as its own user
        with os.fdopen(fd, "w") as out:
            json.dump(groups, out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
