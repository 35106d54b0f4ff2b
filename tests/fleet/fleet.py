"""A Darkroom fleet on hosts of its own, run as an operator would run it: three
NATS hosts (a JetStream cluster, the dispatch stream replicated three times), a
highly available PostgreSQL (a monitor and two data nodes), two control hosts
(each a gateway and a scheduler replica) and two GPU hosts (``darkroom
supervise``: a sampler and a decoder each, on the CPU here). Every service binds
and advertises its own host's address; the mesh is sealed, with certificates that
name those addresses, issued by the fleet's CA as ``darkroom certs issue`` does,
and each host holds only the secrets of the roles it runs."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psycopg

from services.bus.credentials import NatsCredentials
from services.db.states import WorkerStatus
from services.db.worker_records import WorkerRecord
from services.errors import BusError
from services.mesh.nats_auth import CONTROL_USERS, DECODER_USER, sampler_user, server_config
from services.mesh.pki import CertificateAuthority, write_private
from services.mesh.secrets import nats_password_path, password
from services.models.parallel_miniatures import twins
from services.models.registry import toml_value
from services.ops.embedded_nats import nats_server_binary
from services.ops.gpu_groups import group_name
from services.presence_read import presence_now
from tests.fleet.keyed import FLEET_API_KEY, with_key
from tests.fleet.model_store import STORE_MODEL, FleetModelStore
from tests.fleet.network import Host, Network
from tests.fleet.postgres_ha import PostgresHA
from tests.fleet.probes import gateway_up
from tests.helpers import env_of
from tests.store_registry import write_store_registry

NATS_PORT, ROUTE_PORT, GATEWAY_PORT = 4222, 6222, 50051
# Failures noticed in seconds (as the fault suite's stacks), and calls that give
# up on a silent peer rather than wait for TCP's own minutes.
FLEET_SETTINGS: dict[str, object] = {
    "heartbeat_interval_s": 0.5,
    "worker_stale_after_s": 3.0,
    "recovery_interval_s": 0.25,
    "hang_after_s": 10.0,
    "restart_backoff_s": 0.2,
    "restart_backoff_max_s": 2.0,
    "redispatch_after_s": 3.0,
    "dispatch_ack_wait_s": 10.0,
    "shutdown_grace_s": 8.0,
    "outcome_retry_s": 60.0,
    "nats_replicas": 3,
    "log_level": "INFO",
}
# The parallel models a group of two CPU samplers serves: one a single sampler serves
# too (unsplit), so that a group's job can finish elsewhere, and one only a group
# serves (sharded). Checkpoints every 5 steps: a job resumes where the group left it.
GROUP_MODEL, SHARDED_MODEL = "tiny-cfg2", "tiny-tensor2"


@dataclass
class Service:
    """One process the fleet runs: restartable with the same command."""

    host: Host
    name: str
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self, logs: Path) -> None:
        self.proc = self.host.spawn(self.args, env=self.env, log=logs / f"{self.host.name}-{self.name}.log")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # ip netns exec hands the signal on: it execs the service
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Fleet:
    root: Path
    network: Network
    models_dir: Path
    ca: CertificateAuthority = field(default_factory=CertificateAuthority.create)
    services: dict[str, Service] = field(default_factory=dict)

    def __post_init__(self) -> None:
        add = self.network.add
        self.nats = [add(f"nats{i}") for i in (1, 2, 3)]
        self.pg_monitor, *self.pg_nodes = add("pgmon"), add("pg1"), add("pg2")
        self.control = [add("ctl1"), add("ctl2")]
        self.gpus = [add("gpu1"), add("gpu2")]
        # After the first hosts, so that their addresses stay as they were: the model
        # store, and GPU hosts the store scenarios start (their NATS users declared now).
        self.model_store = FleetModelStore(add("store"), self.root)
        self.spare_gpus = [add(f"gpu{i}") for i in (3, 4, 5, 6)]
        self.group_host = add("grp1")  # two CPU samplers as one group, started by its scenario
        self.registry = write_store_registry(self.root / "registry.toml", STORE_MODEL)
        self._add_parallel_models()
        self.logs = self.root / "logs"
        self.operator = self.root / "operator"  # the CA and every password: the operator's, on no host
        self.ca.save(self.operator)
        self.postgres = PostgresHA(self.root / "postgres", self.ca, self.pg_monitor, self.pg_nodes)

    @functools.cached_property
    def operator_mesh(self) -> Path:
        """The test process's own secrets: the operator's certificate and NATS user."""
        return self.mesh_dir(None, ["operator"], ["operator"])

    # What runs where

    @property
    def nats_url(self) -> str:
        return ",".join(f"nats://{h.address}:{NATS_PORT}" for h in self.nats)

    @property
    def gateway_target(self) -> str:
        """Both gateways, as a client behind a name with two addresses sees them."""
        return "ipv4:" + ",".join(f"{h.address}:{GATEWAY_PORT}" for h in self.control)

    @staticmethod
    def worker_id(gpu: Host) -> str:
        return f"{gpu.name}-cpu0"  # darkroom supervise: the host's name and the device

    @staticmethod
    def group_id(host: Host) -> str:
        return f"{host.name}-{group_name('cpu', (0, 1))}"  # its leader registers as the group

    def nats_users(self) -> list[str]:
        samplers = [self.worker_id(g) for g in [*self.gpus, *self.spare_gpus]] + [self.group_id(self.group_host)]
        return [*CONTROL_USERS, *map(sampler_user, samplers)]

    def _add_parallel_models(self) -> None:
        tables = twins(2, checkpoint_every_steps=5)
        with self.registry.open("a") as registry:
            for name in (GROUP_MODEL, SHARDED_MODEL):
                lines = [f'[models."{name}"]', *(f"{k} = {toml_value(v)}" for k, v in tables[name].items())]
                registry.write("\n" + "\n".join(lines) + "\n")

    def mesh_dir(self, host: Host | None, roles: list[str], nats_users: list[str]) -> Path:
        """The host's own secrets (None: the test process's, the operator's client):
        the CA's certificate, a certificate per role it runs naming its address,
        its NATS users' passwords and the database's."""
        name, address = (host.name, host.address) if host is not None else ("client", self.network.client_address)
        mesh = self.root / "hosts" / name / "mesh"
        write_private(mesh / "ca.pem", (self.operator / "ca.pem").read_bytes())
        for role in roles:
            self.ca.issue_into(mesh, role, [address, name])
        for user in nats_users:
            secret = password(nats_password_path(self.operator, user))
            write_private(nats_password_path(mesh, user), secret.encode() + b"\n")
        self.postgres.write_pgpass(mesh / "pgpass")
        return mesh

    def service_env(self, host: Host, mesh: Path, **settings: object) -> dict[str, str]:
        data = self.root / "hosts" / host.name / "data"
        data.mkdir(parents=True, exist_ok=True)
        if not (data / "models").exists():
            (data / "models").symlink_to(self.models_dir, target_is_directory=True)
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(data),
            **env_of(
                data_dir=data,
                database_url=self.postgres.database_url(mesh / "pgpass", mesh / "ca.pem"),
                nats_url=self.nats_url,
                mesh_dir=mesh,
                model_registry=self.registry,
                **{**FLEET_SETTINGS, **settings},
            ),
        }

    def _add(self, host: Host, name: str, args: list[str], env: dict[str, str]) -> Service:
        service = Service(host, name, args, env)
        self.services[f"{host.name}/{name}"] = service
        service.start(self.logs)
        return service

    # Starting

    def start(self) -> None:
        self.model_store.spawn(self.logs)
        self.postgres.start()
        self._start_nats()
        self._migrate()
        for host in self.control:
            mesh = self.mesh_dir(host, ["gateway", "scheduler"], ["gateway", "scheduler"])
            cli = [sys.executable, "-m", "services.ops.cli", "serve"]
            env = self.service_env(
                host, mesh, gateway_host=host.address, gateway_port=GATEWAY_PORT, api_keys=(FLEET_API_KEY,)
            )
            self._add(host, "gateway", [*cli, "gateway"], env)
            self._add(host, "scheduler", [*cli, "scheduler"], self.service_env(host, mesh, scheduler_host=host.address))
        self.model_store.wait_serving()
        for host in self.gpus:
            self.start_gpu(host)
        self.wait_ready()

    def start_gpu(self, host: Host, *, decoders: int = 1, samplers: int = 1, **settings: object) -> Service:
        """``darkroom supervise`` on the GPU host: ``samplers`` CPU samplers (two: a
        group, as the registry's parallel models ask) and ``decoders``."""
        user = sampler_user(self.worker_id(host) if samplers == 1 else self.group_id(host))
        mesh = self.mesh_dir(host, ["sampler", "decoder"], [user, DECODER_USER])
        # The store's reader for its samplers and decoders; the control hosts get nothing of the store.
        store = self.model_store.settings()
        env = self.service_env(
            host, mesh, sampler_host=host.address, decoder_host=host.address, **{**store, **settings}
        )
        args = ["supervise", "--cpu-workers", str(samplers), "--decoders", str(decoders)]
        return self._add(host, "supervise", [sys.executable, "-m", "services.ops.cli", *args], env)

    def stop_gpu(self, host: Host) -> None:
        """Stops (drains) the host's supervise; the fleet no longer watches it."""
        service = self.services.pop(f"{host.name}/supervise", None)
        if service is not None:
            service.stop()

    def _start_nats(self) -> None:
        for host in self.nats:
            mesh = self.mesh_dir(host, ["nats"], self.nats_users())
            store = self.root / "hosts" / host.name / "jetstream"
            config = server_config(
                port=NATS_PORT,
                store_dir=store,
                mesh_dir=mesh,
                users=self.nats_users(),
                name=host.name,
                host=host.address,
                cluster_port=ROUTE_PORT,
                routes=[f"{h.address}:{ROUTE_PORT}" for h in self.nats if h is not host],
            )
            path = mesh.parent / "nats-server.conf"
            write_private(path, config.encode())  # it holds the users' passwords
            self._add(host, "nats", [nats_server_binary(), "-c", str(path)], {})

    def _migrate(self) -> None:
        mesh = self.mesh_dir(self.control[0], [], [])
        env = self.service_env(self.control[0], mesh)
        self.control[0].run([sys.executable, "-m", "services.ops.cli", "migrate"], env=env, timeout=120)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Both gateways answer and every sampler and decoder is registered ready."""
        deadline = time.monotonic() + timeout
        want = {self.worker_id(g) for g in self.gpus}
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                ready = {w.id for w in self.workers_heard() if w.live and w.status == WorkerStatus.READY}
            except BusError:
                ready = set()
            gateways = all(gateway_up(self.gateway_address(h)) for h in self.control)
            if want <= ready and sum(1 for w in ready if "decoder" in w) >= len(self.gpus) and gateways:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the fleet not ready after {timeout}s; see {self.logs}")

    def workers_heard(self) -> list[WorkerRecord]:
        """Every worker in the presence bucket, as the operator reads it."""
        operator = NatsCredentials.of(self.operator_mesh, "operator", "operator")
        return presence_now(self.nats_url.split(","), credentials=operator)

    def _check_alive(self) -> None:
        dead = [n for n, s in self.services.items() if s.proc is not None and s.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited; see {self.logs}")

    # Reading it, as the operator and a client

    @functools.cached_property
    def pg_url(self) -> str:
        """The database as the test process reaches it (the writable node)."""
        client = self.root / "client"
        pgpass = self.postgres.write_pgpass(client / "pgpass")
        shutil.copy(self.operator / "ca.pem", client / "ca.pem")
        url = self.postgres.database_url(pgpass, client / "ca.pem")
        return url.replace("postgresql+psycopg://", "postgresql://") + "&connect_timeout=5"

    def sql(self, statement: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            return list(conn.execute(statement, params).fetchall())  # type: ignore[arg-type]

    def channel(self) -> grpc.Channel:
        """A client's channel to both gateways: it notices a silent gateway within
        seconds (keepalive) and goes on with the other."""
        return with_key(
            grpc.insecure_channel(
                self.gateway_target,
                options=[("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000)],
            )
        )

    @staticmethod
    def gateway_address(host: Host) -> str:
        return f"{host.address}:{GATEWAY_PORT}"

    def channel_to(self, host: Host) -> grpc.Channel:
        """A channel to one control host's gateway alone."""
        return with_key(grpc.insecure_channel(self.gateway_address(host)))

    def impair(self, *, delay_ms: int, loss_percent: float) -> None:
        """Delay and loss on everything every host of the fleet sends."""
        for host in self.network:
            host.impair(delay_ms=delay_ms, loss_percent=loss_percent)

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()
