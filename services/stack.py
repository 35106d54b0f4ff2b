"""The whole stack on one machine, as separate processes: PostgreSQL and nats-server
(embedded, unless URLs are configured), then the VAE worker, one sampler per GPU
(or one on the CPU), the scheduler and the gateway. ``darkroom up`` and the
integration tests both use it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.embedded import EmbeddedNats, EmbeddedPostgres, ManagedProcess, free_port
from services.settings import Settings

MODULES = {"gateway": "gateway", "scheduler": "scheduler", "gpu_worker": "gpu_worker", "vae_worker": "vae_worker"}


def visible_gpus() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0


class ServiceProcess(ManagedProcess):
    def __init__(self, name: str, module: str, env: dict[str, str], log_path: Path) -> None:
        super().__init__()
        self.name = name
        self.module = module
        self.env = env
        self.log_path = log_path

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class LocalStack:
    def __init__(self, settings: Settings, *, cpu_workers: int = 1, durable: bool = True) -> None:
        self.settings = settings
        self.cpu_workers = cpu_workers
        self.durable = durable
        self.postgres: EmbeddedPostgres | None = None
        self.nats: EmbeddedNats | None = None
        self.services: dict[str, ServiceProcess] = {}
        self.log_dir = settings.data_dir / "logs"

    @property
    def gateway_address(self) -> str:
        return f"{self.settings.gateway_host}:{self.settings.gateway_port}"

    def start_backends(self) -> None:
        data = self.settings.data_dir
        data.mkdir(parents=True, exist_ok=True)
        if not self.settings.database_url:
            self.postgres = EmbeddedPostgres(data, durable=self.durable)
            self.postgres.start()
            self.settings = replace(self.settings, database_url=self.postgres.url)
        if not self.settings.nats_url:
            self.nats = EmbeddedNats(data)
            self.nats.start()
            self.settings = replace(self.settings, nats_url=self.nats.url)
        from services.db.migrate import upgrade

        upgrade(self.settings.database_url)

    def service(self, name: str, module: str, **overrides: Any) -> ServiceProcess:
        env = {**os.environ, **replace(self.settings, **overrides).to_env(), "PYTHONUNBUFFERED": "1"}
        return ServiceProcess(name, module, env, self.log_dir / f"{name}.log")

    def add(self, name: str, module: str, **overrides: Any) -> ServiceProcess:
        proc = self.service(name, module, **overrides)
        self.services[name] = proc
        proc.start()
        return proc

    def start(self, timeout: float = 120.0) -> None:
        self.start_backends()
        if not self.settings.gateway_port:
            self.settings = replace(self.settings, gateway_port=free_port())
        # Build models once, up front, rather than in every process that needs them.
        from services.models.registry import BUILTIN_TINY, ModelRegistry, ensure_tiny_model

        registry = ModelRegistry.load(self.settings.model_registry or None)
        builtin = tuple(s.name for s in registry.models.values() if s.source == BUILTIN_TINY)
        for name in builtin:
            ensure_tiny_model(self.settings.models_dir / name)
        if not self.settings.preload_models:
            self.settings = replace(self.settings, preload_models=builtin)
        self.add("vae_worker", "vae_worker")
        gpus = visible_gpus()
        if gpus:
            for i in range(gpus):
                proc = self.service(f"gpu_worker-{i}", "gpu_worker", device="cuda:0")
                proc.env["CUDA_VISIBLE_DEVICES"] = str(i)
                self.services[proc.name] = proc
                proc.start()
        else:
            for i in range(self.cpu_workers):
                self.add(f"gpu_worker-{i}", "gpu_worker", device="cpu")
        self.add("scheduler", "scheduler")
        self.add("gateway", "gateway")
        self.wait_ready(timeout, samplers=gpus or self.cpu_workers)

    def wait_ready(self, timeout: float, *, samplers: int) -> None:
        """Until the gateway answers health checks and the workers have registered."""
        import grpc
        import psycopg
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        url = self.settings.database_url.replace("postgresql+psycopg://", "postgresql://")
        while True:
            for proc in self.services.values():
                if not proc.running:
                    raise RuntimeError(f"{proc.name} exited during start:\n{proc.log_tail()}")
            try:
                with grpc.insecure_channel(self.gateway_address) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                with psycopg.connect(url) as conn:
                    row = conn.execute(
                        "SELECT count(*) FILTER (WHERE kind = 'sampler'), count(*) FILTER (WHERE kind = 'vae') "
                        "FROM workers WHERE status = 'ready' AND last_heartbeat > now() - interval '10 seconds'"
                    ).fetchone()
                assert row is not None
                if reply.status == health_pb2.HealthCheckResponse.SERVING and row[0] >= samplers and row[1] >= 1:
                    return
            except (grpc.RpcError, psycopg.Error):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the stack did not become ready in time; logs are in " + str(self.log_dir))
            time.sleep(0.2)

    def stop(self) -> None:
        # Front to back: stop taking work first, let samplers finish theirs, and keep
        # the decoder up until they have.
        rank = {"gateway": 0, "scheduler": 1, "vae_worker": 3}
        for name in sorted(self.services, key=lambda n: rank.get(n, 2)):
            self.services[name].stop()
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()
