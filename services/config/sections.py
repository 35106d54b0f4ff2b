"""Every Darkroom setting, by the part that reads it. A service process receives the
kernel's section and its own; ``darkroom up`` and ``darkroom supervise`` hold them
all (``Settings``) and pass them down as ``DARKROOM_*`` variables. The reference,
``docs/settings.md``, is written from these definitions (``services.config.docs``).

Here: the kernel's, gateway's, scheduler's and supervisor's sections, and
``Settings``; the sampler's and decoder's are in ``workers``, the HTTP API's in
``http``, placement and preemption in ``placement``. (A few lines over 300: the
sections ``Settings`` holds read best beside it; a split would leave one section alone.)"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.config.fields import Codec, Section, SettingsError, setting
from services.config.http import HttpSettings
from services.config.model_store import ModelStoreSettings
from services.config.placement import PlacementSettings, PreemptionSettings
from services.config.safety import ExpansionSettings, SafetySettings
from services.config.workers import DecoderSettings, SamplerSettings

if TYPE_CHECKING:
    from services.models.registry import ModelRegistry

LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL = Codec("a level", lambda raw: raw.strip().upper(), lambda v: str(v).upper())


def _default_data_dir() -> Path:
    return Path(os.path.expanduser("~/.darkroom"))


@dataclass(frozen=True)
class KernelSettings(Section):
    """What every service reads: where the stores are, logs, metrics, traces, stopping."""

    data_dir: Path = setting(
        doc="Where the embedded stack keeps PostgreSQL, JetStream, built models, logs and liveness files.",
        factory=_default_data_dir,
    )
    database_url: str = setting(
        "", "PostgreSQL, as postgresql+psycopg://user:pass@host:5432/db; empty: `darkroom up` starts its own."
    )
    database_pooled: bool = setting(
        False,
        "Whether DATABASE_URL is a transaction-mode pooler (PgBouncer) rather than PostgreSQL itself: then no "
        "statement is prepared and no startup options are sent (the pooler keeps the idle-transaction timeout "
        "and keepalives). The samplers and decoders of a large fleet go through one: docs/fleet.md.",
    )
    nats_url: str = setting(
        "",
        "NATS with JetStream: one URL, or every node of a cluster comma-separated; empty: `darkroom up` starts "
        "its own.",
    )
    nats_replicas: int = setting(
        1, "Copies JetStream keeps of the dispatch stream: 3 on a three-node cluster.", at_least=1
    )
    mesh_dir: str = setting(
        "",
        "The sealed mesh's secrets: the fleet CA's ca.pem and this service's ROLE.pem and ROLE.key (as `darkroom "
        "certs issue` writes them), and its NATS password; every internal gRPC hop is then mutual TLS with a role "
        "check, and NATS is reached over TLS as this service's own user. Empty: the internal gRPC hops are "
        "plaintext and NATS is reached without credentials (a fleet whose network is trusted). `darkroom up` "
        "sets it to DATA_DIR/secrets.",
    )
    model_registry: str = setting("", "The model registry, a TOML file; empty: the one shipped with Darkroom.")
    presets: tuple[str, ...] = setting(
        (),
        "The registry's on-request models to serve as well: the full-size random-weight presets (sd15-random, "
        "sdxl-random, wan-random, upscaler-random), for benchmarks; they are built on first use (minutes, "
        "gigabytes). Empty: none.",
    )
    heartbeat_interval_s: float = setting(1.0, "How often samplers and decoders heartbeat.", at_least=0.05)
    worker_stale_after_s: float = setting(
        10.0,
        "A worker whose last heartbeat is older than this is given no work, and the jobs it holds go back to "
        "the queue.",
        at_least=0.5,
    )
    shutdown_grace_s: float = setting(
        10.0, "How long a stopping service may take to finish what it is doing.", at_least=0.0
    )
    log_level: str = setting("INFO", "The least severe log lines written.", choices=LOG_LEVELS, codec=LOG_LEVEL)
    log_format: str = setting(
        "json",
        "json: one object per line, with job_id and attempt on every line about a job; text: the same as key=value "
        "after the message.",
        choices=LOG_FORMATS,
    )
    metrics_host: str = setting("127.0.0.1", "Where /metrics listens; 0.0.0.0 lets another host scrape.")
    tenant_metrics_max: int = setting(
        100,
        "Tenants a process labels per-tenant metrics with by name (the first it sees); the rest share the label "
        '"other", so that series do not grow with the number of tenants.',
        at_least=1,
    )
    metrics_port: int = setting(
        0,
        "Prometheus /metrics port; 0 serves none. Under `darkroom up` and `darkroom supervise`: the first of "
        "consecutive ports, one per child (0: a free port each), listed in DATA_DIR/prometheus/targets.json.",
        at_least=0,
    )
    otlp_endpoint: str = setting(
        "",
        "An OpenTelemetry collector's OTLP/gRPC address, http://host:4317 (plaintext) or https://host:4317 (TLS); "
        "empty: no traces.",
    )
    trace_sample_ratio: float = setting(
        1.0,
        "The share of jobs traced, decided at submit: every service follows the gateway.",
        at_least=0.0,
        at_most=1.0,
    )
    liveness_file: str = setting("", "The file a supervised child touches to show it is alive; set by its supervisor.")
    restarts: int = setting(0, "How often the supervisor has restarted this child; set by it.", at_least=0)
    safety: SafetySettings = setting(doc="The prompt and image filters.", factory=SafetySettings)
    model_store: ModelStoreSettings = setting(
        doc="The tiered model store: the object store, each host's cache, the peers.", factory=ModelStoreSettings
    )

    def check(self) -> None:
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise SettingsError(
                f"DARKROOM_OTLP_ENDPOINT={self.otlp_endpoint!r}: must start with http:// (plaintext) or https://"
            )

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def model_cache_dir(self) -> Path:
        """The host's cache of ``store:`` models."""
        return (
            Path(self.model_store.model_cache_dir).expanduser()
            if self.model_store.model_cache_dir
            else (self.data_dir / "model-cache")
        )

    @property
    def nats_servers(self) -> list[str]:
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]

    def registry(self) -> ModelRegistry:
        """The models this fleet serves: the registry's, with the presets asked for."""
        from services.models.registry import ModelRegistry

        return ModelRegistry.load(self.model_registry or None, presets=self.presets)


@dataclass(frozen=True)
class GatewaySettings(Section):
    """The public gRPC front door."""

    host: str = setting("127.0.0.1", "Where the gateway listens.", env="GATEWAY_HOST")
    port: int = setting(50051, "The gateway's port; 0 picks a free one.", env="GATEWAY_PORT", at_least=0)
    tls_cert: str = setting(
        "",
        "A PEM certificate (chain) for the public port: clients then reach it over TLS. Empty: plaintext. "
        "Renewed files are served from the next handshake on.",
        env="GATEWAY_TLS_CERT",
    )
    tls_key: str = setting("", "The PEM key of GATEWAY_TLS_CERT.", env="GATEWAY_TLS_KEY")
    api_keys: tuple[str, ...] = setting(
        (),
        "Keys of the default tenant, admin (Bearer), beside tenants' own keys; with none and no tenant defined, "
        "the API is open: allowed only while the gateway and the HTTP API listen on loopback addresses, or with "
        "ALLOW_ANONYMOUS.",
    )
    allow_anonymous: bool = setting(
        False,
        "Let the API be open (no tenant defined, API_KEYS empty: every caller an admin of the default tenant) "
        "although GATEWAY_HOST or HTTP_HOST is off the loopback. False: such a gateway refuses to start until a "
        "tenant or a key exists.",
        env="ALLOW_ANONYMOUS",
    )
    max_prompt_chars: int = setting(2000, "The longest prompt (and negative prompt) accepted.", at_least=1)
    max_input_mb: float = setting(
        16.0,
        "The largest input image (or mask) an edit or upscale may send, in MiB; larger ones are refused before "
        "anything is stored. At most 24: an image and its mask travel in one gRPC message of at most 64 MiB.",
        at_least=0.01,
        at_most=24.0,
    )
    max_adapter_mb: float = setting(
        256.0,
        "The largest LoRA adapter file a tenant may upload (UploadAdapter, POST /v1/adapters), in MiB: a larger "
        "one is refused before a byte of it is read.",
        at_least=0.01,
        at_most=8192.0,
    )
    tenant_adapters_max: int = setting(
        20,
        "How many adapter versions of its own a tenant may keep, where its terms set none (`darkroom tenants "
        "update NAME --max-adapters N`).",
        at_least=0,
    )
    tenant_adapter_mb: float = setting(
        1024.0,
        "How many MiB of adapters of its own a tenant may keep in all, where its terms set none (`--adapter-mb`).",
        at_least=0.0,
    )
    adapter_check_timeout_s: float = setting(
        120.0,
        "How long the check of an uploaded adapter (its file read and matched against the base model's network, "
        "in a process of its own) may take before the upload is refused.",
        at_least=1.0,
    )
    placement: PlacementSettings = setting(doc="Lanes and latency classes, for admission.", factory=PlacementSettings)
    expansion: ExpansionSettings = setting(doc="Prompt expansion.", factory=ExpansionSettings)

    def check(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("DARKROOM_GATEWAY_TLS_CERT and DARKROOM_GATEWAY_TLS_KEY: set both, or neither")


@dataclass(frozen=True)
class SchedulerSettings(Section):
    """Placement, recovery and warm-set planning."""

    host: str = setting("127.0.0.1", "Where the scheduler serves gRPC health checking.", env="SCHEDULER_HOST")
    port: int = setting(0, "The scheduler's health port; 0 picks a free one.", env="SCHEDULER_PORT", at_least=0)
    interval_s: float = setting(
        0.05,
        "How often a scheduler with nothing to wake it looks for work.",
        env="SCHEDULER_INTERVAL_S",
        at_least=0.001,
    )
    idle_interval_max_s: float = setting(
        0.5,
        "The longest a scheduler that hears work events waits between passes that find nothing: the interval "
        "doubles from interval_s up to this while nothing comes (the events wake it at once; the passes are the "
        "net for one lost).",
        env="SCHEDULER_IDLE_INTERVAL_MAX_S",
        at_least=0.001,
    )
    batch: int = setting(64, "Queued jobs one placement pass reads per lane.", env="SCHEDULER_BATCH", at_least=1)
    recovery_interval_s: float = setting(
        1.0, "How often the scheduler looks for stalled, expired and exhausted jobs.", at_least=0.05
    )
    max_attempts: int = setting(
        3,
        "Failed attempts (a crash, a timeout, an error) after which a job is FAILED, with each one's reason.",
        at_least=1,
    )
    redispatch_after_s: float = setting(
        15.0,
        "A SCHEDULED job not started after this long is published again (same message id: JetStream drops it if the "
        "first publish got through).",
        at_least=0.1,
    )
    worker_forget_after_s: float = setting(
        3600.0,
        "A worker silent this long, holding nothing, is forgotten: its registry row, its JetStream consumer and "
        "its subject.",
        at_least=1.0,
    )
    plan_interval_s: float = setting(15.0, "How often the warm-set planner runs.", at_least=0.1)
    demand_window_s: float = setting(120.0, "How much demand history the warm-set planner weighs.", at_least=1.0)
    placement: PlacementSettings = setting(doc="How jobs are placed.", factory=PlacementSettings)
    preemption: PreemptionSettings = setting(doc="Which running jobs may be suspended.", factory=PreemptionSettings)


@dataclass(frozen=True)
class SupervisorSettings(Section):
    """`darkroom up` and `darkroom supervise`: restarting what exits or hangs."""

    hang_after_s: float = setting(
        15.0, "A child that has not shown it is alive for this long is hung: killed and restarted.", at_least=1.0
    )
    restart_backoff_s: float = setting(0.5, "The first restart delay, doubling with each quick failure.", at_least=0.0)
    restart_backoff_max_s: float = setting(30.0, "The longest restart delay.", at_least=0.0)
    fork_server: bool = setting(
        True,
        "On a host without a GPU, fork the services from processes that imported their libraries (torch, diffusers, "
        "gRPC...) once, rather than starting each as a new process (services/ops/forkserver.py).",
    )
    gpu_groups: str = setting(
        "auto",
        "Which of the host's GPUs (or CPU samplers) form groups, each one sampler serving parallel models "
        "(docs/parallel.md): `auto`, one group of the largest size the registry's parallel models name, of the "
        "best-connected devices as NVML says, the rest single; `off`; or ranges such as `4-7` or `0-1,2-3`.",
        env="GPU_GROUPS",
    )


@dataclass(frozen=True)
class Settings(Section):
    """All of them: what `darkroom up` and `darkroom supervise` read and pass down."""

    kernel: KernelSettings = setting(doc="Every service.", factory=KernelSettings)
    gateway: GatewaySettings = setting(doc="The gateway.", factory=GatewaySettings)
    scheduler: SchedulerSettings = setting(doc="The scheduler.", factory=SchedulerSettings)
    sampler: SamplerSettings = setting(doc="Each sampler.", factory=SamplerSettings)
    decoder: DecoderSettings = setting(doc="Each decoder.", factory=DecoderSettings)
    http: HttpSettings = setting(doc="The HTTP API.", factory=HttpSettings)
    supervisor: SupervisorSettings = setting(doc="The supervisor.", factory=SupervisorSettings)

    def with_env(self, env: Mapping[str, str]) -> Settings:
        """These settings with some variables changed, as a child would read them."""
        return Settings.from_env({**self.to_env(), **env})
