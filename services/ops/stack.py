"""The whole stack on one machine, as separate supervised processes: PostgreSQL and
nats-server (embedded, unless URLs are configured), then the VAE worker, one
sampler per GPU (or CPU samplers), the scheduler and the gateway. ``darkroom up``
and the integration tests both use it; which processes a host runs is in
``services.ops.children``, shared with ``darkroom supervise``.

The stack holds its data directory's lock while it runs (``data_lock``): backends
found running on it were left by an ``up`` that died, and are stopped cleanly
before its own start (``orphans``). Its own backends are supervised like its
children (``backends``), and every process it starts dies with it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from services.config.fields import SettingsError
from services.config.sections import Settings
from services.mesh.nats_auth import sampler_user
from services.mesh.secrets import ensure_certificates, password
from services.ops.backends import BackendMetrics, SupervisedBackend
from services.ops.children import (
    MetricsPorts,
    child,
    host_children,
    metrics_targets,
    restart_policy,
    stop_order,
)
from services.ops.data_lock import DataDirLock
from services.ops.embedded import EmbeddedPostgres
from services.ops.embedded_nats import EmbeddedNats
from services.ops.model_store import READER_SECRET_FILE, WRITER_SECRET_FILE, EmbeddedModelStore, StoreIdentity
from services.ops.orphans import stop_nats_servers
from services.ops.processes import free_port
from services.ops.supervisor import Child, Supervisor
from services.telemetry.metrics import Target, targets_path, write_targets


class LocalStack:
    def __init__(
        self,
        settings: Settings,
        *,
        cpu_workers: int = 1,
        decoders: int = 1,
        durable: bool = True,
        http: bool = False,
        model_store: bool = False,
    ) -> None:
        self.settings = settings
        self.cpu_workers = cpu_workers
        self.decoders = decoders
        self.durable = durable
        self.http = http  # the HTTP API too (`darkroom up`)
        self.postgres: EmbeddedPostgres | None = None
        self.nats: EmbeddedNats | None = None
        # `up --model-store`: a local S3 server for `store:` models, unless DARKROOM_MODEL_STORE_URL names one.
        self.start_model_store = model_store
        self.model_store: EmbeddedModelStore | None = None
        self.supervisor = Supervisor(restart_policy(settings))
        self.log_dir = settings.kernel.data_dir / "logs"
        self.metrics_ports = MetricsPorts(settings.kernel.metrics_port)
        self.lock = DataDirLock(settings.kernel.data_dir)
        # The stack's own metrics (its backends' restarts), served by `up` itself.
        self.backend_metrics = BackendMetrics()
        self.own_metrics: Target | None = None

    @property
    def services(self) -> dict[str, Child]:
        return self.supervisor.children

    @property
    def gateway_address(self) -> str:
        return f"{self.settings.gateway.host}:{self.settings.gateway.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.settings.http.host}:{self.settings.http.port}"

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
        self.lock.acquire()
        if not self.settings.kernel.mesh_dir:
            # Sealed by default: the CA, a certificate per role, and passwords, made once.
            ensure_certificates(data / "secrets")
            self.settings = self.settings.with_env({"DARKROOM_MESH_DIR": str(data / "secrets")})
        if not self.settings.kernel.database_url:
            self.postgres = EmbeddedPostgres(data, durable=self.durable, mesh_dir=Path(self.settings.kernel.mesh_dir))
            self.postgres.start(take_over=True)  # the lock is ours: a server on its data is an orphan
            self.settings = self.settings.with_env({"DARKROOM_DATABASE_URL": self.postgres.url})
        if not self.settings.kernel.nats_url:
            self.nats = EmbeddedNats(data, mesh_dir=Path(self.settings.kernel.mesh_dir))
            stop_nats_servers(self.nats.config_path)  # orphans on its store, as above
            self.nats.start()
            self.settings = self.settings.with_env({"DARKROOM_NATS_URL": self.nats.url})
        if self.start_model_store and not self.settings.kernel.model_store.model_store_url:
            secrets = Path(self.settings.kernel.mesh_dir)
            # Made once, kept with the others: the writer's for the operator's
            # `darkroom models`, the reader's for the samplers and decoders.
            self.model_store = EmbeddedModelStore(
                data / "model-store",
                bucket=self.settings.kernel.model_store.model_store_bucket,
                writer=StoreIdentity("darkroom-writer", password(secrets / WRITER_SECRET_FILE)),
                reader=StoreIdentity("darkroom-reader", password(secrets / READER_SECRET_FILE)),
            )
            self.model_store.start()
            self.settings = self.settings.with_env(self.model_store.reader_env())
        for name, backend in (("postgres", self.postgres), ("nats", self.nats), ("model-store", self.model_store)):
            if backend is not None:
                self.supervisor.watch(SupervisedBackend(name, backend, self.backend_metrics))
        from services.db.migrate import upgrade

        upgrade(self.settings.kernel.database_url)

    def check_open_access(self) -> None:
        """Raises SettingsError, naming the fix, where the gateway would refuse to
        start: open (no tenants, no keys) with a listener off the loopback
        (``services.open_access``). Said here, before any child starts, rather than
        by a gateway its supervisor restarts."""
        from services.open_access import anonymous_allowed, refusal

        gateway, http = self.settings.gateway, self.settings.http
        if gateway.api_keys or anonymous_allowed(gateway, http):
            return
        import psycopg

        with psycopg.connect(self.pg_url, connect_timeout=5) as conn:
            row = conn.execute("SELECT EXISTS (SELECT 1 FROM tenants)").fetchone()
        why = refusal(gateway, http, tenants_exist=bool(row and row[0]))
        if why:
            raise SettingsError(why)

    def metrics_targets(self) -> list[Target]:
        own = [self.own_metrics] if self.own_metrics is not None else []
        return metrics_targets(self.services.values()) + own

    def _serve_own_metrics(self) -> None:
        """``up``'s own /metrics (its backends' restarts), on the next metrics port."""
        import socket

        from services.bus.dispatch import host_token

        host, port = self.settings.kernel.metrics_host, self.metrics_ports.next()
        if not self.backend_metrics.serve(host, port):
            return
        if host in ("0.0.0.0", "::"):
            host = socket.getfqdn()  # listening everywhere: named as other hosts know it
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.own_metrics = Target("up", "up", host_token(), address)
        write_targets(targets_path(self.settings.kernel.data_dir), self.metrics_targets())

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
        self.check_open_access()
        if not self.settings.gateway.port:
            self.settings = self.settings.with_env({"DARKROOM_GATEWAY_PORT": str(free_port())})
        # Build models once, up front, rather than in every process that needs them.
        from services.models.builtins import BUILTINS, MINIATURES, ensure_builtin

        registry = self.settings.kernel.registry()
        miniatures = sorted(s.name for s in registry.models.values() if s.source in MINIATURES)
        for name in miniatures:
            ensure_builtin(BUILTINS[registry.get(name).source], self.settings.kernel.models_dir / name)
        if not self.settings.sampler.preload_models:
            # The default image model, warmed up before the first job; the others load on demand.
            image = registry.default_for("image")
            if image is not None and image.name in miniatures:
                self.settings = self.settings.with_env({"DARKROOM_PRELOAD_MODELS": image.name})
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
        if self.http:
            self._add_http()
        self._serve_own_metrics()
        self.supervisor.start()
        self.wait_ready(timeout)

    def _add_http(self) -> None:
        """The HTTP API, speaking to this stack's gateway, signing links with a key
        kept beside the stack's other secrets."""
        from services.mesh.secrets import password

        secrets = Path(self.settings.kernel.mesh_dir or self.settings.kernel.data_dir / "secrets")
        secrets.mkdir(parents=True, exist_ok=True)
        password(secrets / "http-url.key")  # made once, random, 0600
        env = {
            "DARKROOM_HTTP_PORT": str(self.settings.http.port or free_port()),
            "DARKROOM_HTTP_GATEWAY": self.gateway_address,
            "DARKROOM_HTTP_URL_KEY_FILE": str(secrets / "http-url.key"),
        }
        roots = self.gateway_roots()
        if roots is not None:
            trusted = secrets / "gateway-roots.pem"
            trusted.write_bytes(roots)
            env["DARKROOM_HTTP_GATEWAY_TLS_CA"] = str(trusted)
        self.settings = self.settings.with_env(env)
        self.add("http", "http", {"DARKROOM_METRICS_PORT": str(self.metrics_ports.next())})

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
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from services.bus.credentials import NatsCredentials
        from services.db.states import WorkerKind, WorkerStatus
        from services.errors import BusError
        from services.presence_read import presence_now
        from services.rpc.client import gateway_channel

        want = len(self.sampler_ids()) if samplers is None else samplers
        roots = self.gateway_roots()
        deadline = time.monotonic() + timeout
        while True:
            try:
                with gateway_channel(self.gateway_address, roots) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                kernel = self.settings.kernel
                operator = NatsCredentials.of(kernel.mesh_dir, "operator", "operator") if kernel.mesh_dir else None
                ready = [
                    w
                    for w in presence_now(kernel.nats_servers, credentials=operator)
                    if w.live and w.status == WorkerStatus.READY
                ]
                samplers = sum(1 for w in ready if w.kind == WorkerKind.SAMPLER)
                decoders = len(ready) - samplers
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                if serving and samplers >= want and decoders >= self.decoders and self._http_listening():
                    return
            except (grpc.RpcError, BusError):
                pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {c.name} ---\n{c.log_tail(1500)}" for c in self.services.values())
                raise TimeoutError(f"the stack did not become ready in {timeout:.0f}s; logs in {self.log_dir}\n{tails}")
            time.sleep(0.2)

    def _http_listening(self) -> bool:
        if not self.http:
            return True
        import socket

        try:
            with socket.create_connection((self.settings.http.host, self.settings.http.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        # Samplers get their drain's grace before SIGKILL.
        self.supervisor.stop(stop_order(list(self.services)), timeout=self.settings.kernel.shutdown_grace_s + 5.0)
        # A stopped stack is no target: an alert on `up == 0` then means a crash, not Ctrl-C.
        # (A stack refused the data directory's lock lists nothing: the targets are another's.)
        if self.lock.held:
            write_targets(targets_path(self.settings.kernel.data_dir), [])
        self.backend_metrics.close()
        if self.nats is not None:
            self.nats.stop()
        if self.model_store is not None:
            self.model_store.stop()
        if self.postgres is not None:
            self.postgres.stop()
        self.lock.release()
