"""The whole stack on one machine, as separate supervised processes: PostgreSQL and
nats-server (embedded, unless URLs are configured), then the VAE worker, one
sampler per GPU (or CPU samplers), the scheduler and the gateway. ``darkroom up``
and the integration tests both use it; ``darkroom supervise`` uses ``host_children``
for the sampler side of a GPU host."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from services.bus.dispatch import host_token
from services.config.fields import ENV_PREFIX
from services.config.sections import Settings
from services.mesh.nats_auth import sampler_user
from services.mesh.secrets import ensure_certificates
from services.ops import SERVICE_MODULES
from services.ops.embedded import EmbeddedPostgres, free_port
from services.ops.embedded_nats import EmbeddedNats
from services.ops.supervisor import Child, RestartPolicy, Supervisor
from services.telemetry.metrics import Target, targets_path, write_targets

# Stopping front to back: stop taking work first, let samplers finish (or hand
# back) theirs, and keep the decoders up until they have.
STOP_ORDER_RANK = {"gateway": 0, "scheduler": 1, "sampler": 2, "decoder": 3}


def visible_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0


def restart_policy(settings: Settings) -> RestartPolicy:
    supervisor = settings.supervisor
    return RestartPolicy(
        backoff_s=supervisor.restart_backoff_s,
        backoff_max_s=supervisor.restart_backoff_max_s,
        hang_after_s=supervisor.hang_after_s,
        kill_grace_s=min(settings.kernel.shutdown_grace_s, 5.0),
    )


def child(settings: Settings, name: str, service: str, env: Mapping[str, str] | None = None) -> Child:
    """A supervised process of ``service`` (a key of SERVICE_MODULES) with these
    settings, changed by the ``DARKROOM_*`` variables of ``env`` (checked here,
    so that a bad one stops the caller), and the rest of ``env`` beside them."""
    env = env or {}
    own = settings.with_env({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)})
    others = {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)}
    data = settings.kernel.data_dir
    return Child(
        name,
        SERVICE_MODULES[service],
        {**os.environ, **own.to_env(), **others},
        data / "logs" / f"{name}.log",
        data / "run" / f"{name}.alive",
        service=service,
    )


class MetricsPorts:
    """Each supervised child's metrics port, kept across its restarts: consecutive
    from ``first`` (ports an operator can name), or free ones when it is 0."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.given: list[int] = []

    def next(self) -> int:
        if self.first:
            port = self.first + len(self.given)
        else:
            port = free_port()
            while port in self.given:  # free now, but maybe just handed to a child that has not bound it
                port = free_port()
        self.given.append(port)
        return port


def host_children(
    settings: Settings, *, decoders: int, cpu_samplers: int = 1, ports: MetricsPorts | None = None
) -> list[Child]:
    """A GPU host's processes: ``decoders`` VAE workers and one sampler per visible
    GPU (``CUDA_VISIBLE_DEVICES`` set for each), or CPU samplers when there is
    none. Worker ids come from the host and the GPU, so a restarted sampler takes
    back its own subject. Metrics ports go to the samplers first, by GPU, then to
    the decoders: a sampler's port does not move when the decoders change."""
    ports = ports or MetricsPorts(settings.kernel.metrics_port)
    host = host_token()
    samplers = []
    gpus = visible_gpus()
    threads: dict[str, str] = {}
    if gpus:
        for i in range(gpus):
            samplers.append(
                child(
                    settings,
                    f"sampler-{i}",
                    "sampler",
                    {
                        "CUDA_VISIBLE_DEVICES": str(i),
                        "DARKROOM_DEVICE": "cuda:0",
                        "DARKROOM_WORKER_ID": f"{host}-gpu{i}",
                        "DARKROOM_METRICS_PORT": str(ports.next()),
                    },
                )
            )
    else:
        # Without a GPU, samplers and decoders compute on the CPU: each gets its
        # share of the cores. torch's threads, every process's on every core at
        # once, spin and wait on each other and make each step many times slower.
        share = max(1, (os.cpu_count() or 1) // max(cpu_samplers + decoders, 1))
        threads = {"OMP_NUM_THREADS": str(share)}
        for i in range(cpu_samplers):
            samplers.append(
                child(
                    settings,
                    f"sampler-{i}",
                    "sampler",
                    {
                        **threads,
                        "DARKROOM_DEVICE": "cpu",
                        "DARKROOM_WORKER_ID": f"{host}-cpu{i}",
                        "DARKROOM_METRICS_PORT": str(ports.next()),
                    },
                )
            )
    vaes = [
        child(
            settings,
            f"decoder-{i}",
            "decoder",
            {**threads, "DARKROOM_WORKER_ID": f"{host}-decoder{i}", "DARKROOM_METRICS_PORT": str(ports.next())},
        )
        for i in range(decoders)
    ]
    # Decoders start first: a sampler that is ready has somewhere to decode.
    return vaes + samplers


def metrics_target(c: Child) -> Target | None:
    """Where Prometheus scrapes the child (None: it serves no metrics)."""
    port = int(c.env.get(f"{ENV_PREFIX}METRICS_PORT") or 0)
    if not port:
        return None
    host = c.env.get(f"{ENV_PREFIX}METRICS_HOST") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = socket.getfqdn()  # listening everywhere: named as other hosts know it
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Target(c.name, c.service, host_token(), address)


def metrics_targets(children: Iterable[Child]) -> list[Target]:
    return [t for t in map(metrics_target, children) if t is not None]


def stop_order(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: STOP_ORDER_RANK.get(n.split("-")[0], 2))


class LocalStack:
    def __init__(self, settings: Settings, *, cpu_workers: int = 1, decoders: int = 1, durable: bool = True) -> None:
        self.settings = settings
        self.cpu_workers = cpu_workers
        self.decoders = decoders
        self.durable = durable
        self.postgres: EmbeddedPostgres | None = None
        self.nats: EmbeddedNats | None = None
        self.supervisor = Supervisor(restart_policy(settings))
        self.log_dir = settings.kernel.data_dir / "logs"
        self.metrics_ports = MetricsPorts(settings.kernel.metrics_port)

    @property
    def services(self) -> dict[str, Child]:
        return self.supervisor.children

    @property
    def gateway_address(self) -> str:
        return f"{self.settings.gateway.host}:{self.settings.gateway.port}"

    def gateway_roots(self) -> bytes | None:
        """What a client of this stack's gateway trusts: None, plaintext; else the
        gateway's own certificate (self-signed), the fleet's CA (a certificate of
        `darkroom certs issue gateway`) and the system's CAs."""
        gateway = self.settings.gateway
        if not gateway.tls_cert:
            return None
        import ssl

        candidates = [Path(gateway.tls_cert)]
        if self.settings.kernel.mesh_dir:
            candidates.append(Path(self.settings.kernel.mesh_dir) / "ca.pem")
        system = ssl.get_default_verify_paths().cafile
        if system:
            candidates.append(Path(system))
        return b"".join(p.read_bytes() for p in candidates if p.is_file())

    @property
    def pg_url(self) -> str:
        """The database URL for psycopg (no SQLAlchemy driver suffix)."""
        return self.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")

    def start_backends(self) -> None:
        data = self.settings.kernel.data_dir
        data.mkdir(parents=True, exist_ok=True)
        if not self.settings.kernel.mesh_dir:
            # Sealed by default: the CA, a certificate per role, and passwords, made once.
            ensure_certificates(data / "secrets")
            self.settings = self.settings.with_env({"DARKROOM_MESH_DIR": str(data / "secrets")})
        if not self.settings.kernel.database_url:
            self.postgres = EmbeddedPostgres(data, durable=self.durable, mesh_dir=Path(self.settings.kernel.mesh_dir))
            self.postgres.start()
            self.settings = self.settings.with_env({"DARKROOM_DATABASE_URL": self.postgres.url})
        if not self.settings.kernel.nats_url:
            self.nats = EmbeddedNats(data, mesh_dir=Path(self.settings.kernel.mesh_dir))
            self.nats.start()
            self.settings = self.settings.with_env({"DARKROOM_NATS_URL": self.nats.url})
        from services.db.migrate import upgrade

        upgrade(self.settings.kernel.database_url)

    def metrics_targets(self) -> list[Target]:
        return metrics_targets(self.services.values())

    def add(self, name: str, service: str, env: Mapping[str, str] | None = None) -> Child:
        """Starts one more supervised process of ``service``, with ``env`` changing
        its settings (see ``child``) and a metrics port of its own."""
        env = {"DARKROOM_METRICS_PORT": str(self.metrics_ports.next()), **(env or {})}
        added = child(self.settings, name, service, env)
        if service == "sampler":
            self._let_into_nats([added])
        self.supervisor.add(added)
        write_targets(targets_path(self.settings.kernel.data_dir), self.metrics_targets())
        return added

    def start(self, timeout: float = 120.0) -> None:
        self.start_backends()
        if not self.settings.gateway.port:
            self.settings = self.settings.with_env({"DARKROOM_GATEWAY_PORT": str(free_port())})
        # Build models once, up front, rather than in every process that needs them.
        from services.models.registry import BUILTIN_TINY, ModelRegistry, ensure_tiny_model

        registry = ModelRegistry.load(self.settings.kernel.model_registry or None)
        builtin = [s.name for s in registry.models.values() if s.source == BUILTIN_TINY]
        for name in builtin:
            ensure_tiny_model(self.settings.kernel.models_dir / name)
        if not self.settings.sampler.preload_models:
            self.settings = self.settings.with_env({"DARKROOM_PRELOAD_MODELS": ",".join(builtin)})
        # Metrics ports in a fixed order: gateway, scheduler, samplers, decoders.
        gateway_metrics, scheduler_metrics = self.metrics_ports.next(), self.metrics_ports.next()
        host = host_children(
            self.settings, decoders=self.decoders, cpu_samplers=self.cpu_workers, ports=self.metrics_ports
        )
        self._let_into_nats(host)
        for c in host:
            self.supervisor.add(c)
        self.add("scheduler", "scheduler", {"DARKROOM_METRICS_PORT": str(scheduler_metrics)})
        self.add("gateway", "gateway", {"DARKROOM_METRICS_PORT": str(gateway_metrics)})
        self.supervisor.start()
        self.wait_ready(timeout)

    def _let_into_nats(self, children: Iterable[Child]) -> None:
        """Gives each sampler among ``children`` its own NATS user, on the embedded
        server (an operator's NATS lists its users itself: docs/security.md)."""
        if self.nats is None or self.nats.mesh_dir is None:
            return
        ids = [c.env["DARKROOM_WORKER_ID"] for c in children if c.service == "sampler"]
        if ids:
            self.nats.set_users([*self.nats.users, *map(sampler_user, ids)])

    def sampler_ids(self) -> list[str]:
        return sorted(c.env["DARKROOM_WORKER_ID"] for n, c in self.services.items() if n.startswith("sampler"))

    def wait_ready(self, timeout: float, *, samplers: int | None = None) -> None:
        """Until the gateway answers health checks and the workers have registered.
        A child that dies meanwhile is restarted by the supervisor, not fatal."""
        import grpc
        import psycopg
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from services.rpc.client import gateway_channel

        want = len(self.sampler_ids()) if samplers is None else samplers
        roots = self.gateway_roots()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with gateway_channel(self.gateway_address, roots) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                with psycopg.connect(self.pg_url, connect_timeout=2) as conn:
                    row = conn.execute(
                        "SELECT count(*) FILTER (WHERE kind = 'sampler'), count(*) FILTER (WHERE kind = 'decoder') "
                        "FROM workers WHERE status = 'ready' AND last_heartbeat > now() - interval '10 seconds'"
                    ).fetchone()
                assert row is not None
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                if serving and row[0] >= want and row[1] >= self.decoders:
                    return
            except (grpc.RpcError, psycopg.Error):
                pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {c.name} ---\n{c.log_tail(1500)}" for c in self.services.values())
                raise TimeoutError(f"the stack did not become ready in {timeout:.0f}s; logs in {self.log_dir}\n{tails}")
            time.sleep(0.2)

    def stop(self) -> None:
        # Samplers get their drain's grace before SIGKILL.
        self.supervisor.stop(stop_order(list(self.services)), timeout=self.settings.kernel.shutdown_grace_s + 5.0)
        # A stopped stack is no target: an alert on `up == 0` then means a crash, not Ctrl-C.
        write_targets(targets_path(self.settings.kernel.data_dir), [])
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()
