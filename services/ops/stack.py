"""The whole stack on one machine, as separate supervised processes: PostgreSQL and
nats-server (embedded, unless URLs are configured), then the VAE worker, one
sampler per GPU (or CPU samplers), the scheduler and the gateway. ``darkroom up``
and the integration tests both use it; which processes a host runs is in
``services.ops.children``, shared with ``darkroom supervise``. Here: the services,
their readiness and their metrics; the backends beneath them and the data
directory's lock are ``stack_backends``'s. Every process it starts dies with it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from services.config.sections import Settings
from services.mesh.nats_auth import sampler_user
from services.mesh.secrets import compile_signing_key, password
from services.ops.children import MetricsPorts, child, host_children, metrics_targets, stop_order
from services.ops.processes import free_port
from services.ops.stack_backends import StackBackends
from services.ops.supervisor import Child
from services.telemetry.metrics import Target, targets_path, write_targets


class LocalStack(StackBackends):
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
        super().__init__(settings, durable=durable, model_store=model_store)
        self.cpu_workers = cpu_workers
        self.decoders = decoders
        self.http = http  # the HTTP API too (`darkroom up`)
        self.log_dir = settings.kernel.data_dir / "logs"
        self.metrics_ports = MetricsPorts(settings.kernel.metrics_port)
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
        self._give_samplers_a_signing_key()
        if not self.settings.gateway.port:
            self.settings = self.settings.with_env({"DARKROOM_GATEWAY_PORT": str(free_port())})
        # Build models once, up front, rather than in every process that needs them.
        from services.models.builtins import BUILTINS, MINIATURES, builtin_dir, ensure_builtin

        registry = self.settings.kernel.registry()
        miniatures = sorted(s.name for s in registry.models.values() if s.source in MINIATURES)
        for name in miniatures:
            source = registry.get(name).source
            ensure_builtin(BUILTINS[source], builtin_dir(self.settings.kernel.models_dir, source))
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

    def _give_samplers_a_signing_key(self) -> None:
        """With a model store, the samplers' key for the compiled artifacts they
        share through it (``services.models.compile_record``), unless settings name
        one: made once beside the stack's other secrets. Only samplers read it
        (``services.ops.children``)."""
        kernel = self.settings.kernel
        if not kernel.model_store.model_store_url or self.settings.sampler.compile_signing_key is not None:
            return
        secrets = Path(kernel.mesh_dir or kernel.data_dir / "secrets")
        self.settings = self.settings.with_env({"DARKROOM_COMPILE_SIGNING_KEY_FILE": str(compile_signing_key(secrets))})

    def _add_http(self) -> None:
        """The HTTP API, speaking to this stack's gateway, signing links with a key
        kept beside the stack's other secrets."""
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
        """The samplers that register: each single one and each group's leader."""
        return sorted(
            c.env["DARKROOM_WORKER_ID"]
            for n, c in self.services.items()
            if n.startswith("sampler") and c.env.get("DARKROOM_GROUP_RANK", "0") == "0"
        )

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
        self.stop_backends()
