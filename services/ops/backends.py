"""The backends ``darkroom up`` runs beside its services (the embedded PostgreSQL
and nats-server), watched by its supervisor as its children are. One that dies
(a crash, the OOM killer, ``kill -9``) is reaped, logged, counted in
``darkroom_backend_restarts`` and started again on its own port and data, after
the children's backoff; the services reconnect to it by themselves, and the jobs
they had in flight finish. ``up`` serves these metrics on a port of its own,
listed for Prometheus beside its children's."""

from __future__ import annotations

import logging
import threading
import time
from importlib import metadata
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, ProcessCollector, start_http_server

from services.ops.processes import Process
from services.ops.supervisor import STABLE_AFTER_S, RestartPolicy, describe_exit

log = logging.getLogger(__name__)


class Backend(Protocol):
    """A backend's process (EmbeddedPostgres, EmbeddedNats): ``start`` returns once
    it serves, on the port and data it had."""

    proc: Process | None

    @property
    def running(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self, timeout: float = ...) -> None: ...


class BackendMetrics:
    """``up``'s own metrics, in a registry of its own: a stack in a test's process
    counts only its own backends' restarts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        try:
            version = metadata.version("darkroom")
        except metadata.PackageNotFoundError:
            version = "unknown"
        Info("darkroom_build", "The Darkroom version and which service this process is.", registry=self.registry).info(
            {"service": "up", "version": version}
        )
        self.restarts = Counter(
            "darkroom_backend_restarts",
            "Times `darkroom up` started a backend of its own (postgres, nats) again after it died.",
            ["backend"],
            registry=self.registry,
        )
        self.up = Gauge(
            "darkroom_backend_up",
            "1 while a backend of `darkroom up` (postgres, nats) runs; 0 from its death until it is started again.",
            ["backend"],
            registry=self.registry,
        )
        self.server: WSGIServer | None = None

    def serve(self, host: str, port: int) -> bool:
        """Serves ``/metrics`` from a thread; a port that cannot be had is logged,
        not fatal (Prometheus shows the target down)."""
        try:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            log.error("cannot serve darkroom up's metrics on %s:%d: %s", host, port, exc)
            return False
        return True

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class SupervisedBackend:
    """A backend the supervisor keeps running: ``check`` (the supervisor's, every
    poll) reaps a dead one and starts it again when its backoff is over."""

    def __init__(self, name: str, process: Backend, metrics: BackendMetrics) -> None:
        self.name = name
        self.process = process
        self.metrics = metrics
        self.restarts = 0
        self.quick_failures = 0
        self.started_at = time.monotonic()
        self.next_start_at = 0.0
        self.last_exit: str | None = None
        self.lock = threading.RLock()
        metrics.up.labels(backend=name).set(1 if process.running else 0)
        metrics.restarts.labels(backend=name)  # 0 until the first restart, not absent

    def check(self, now: float, policy: RestartPolicy) -> None:
        with self.lock:
            if self.process.running:  # polls it: a dead one is reaped here
                return
            proc = self.process.proc
            if proc is not None:
                self._down(now, policy, f"it exited with {describe_exit(proc.returncode)}")
            if now < self.next_start_at:
                return
            try:
                self.process.start()
            except Exception as exc:  # its log says why; try again after the backoff
                self.process.stop(policy.kill_grace_s)
                self._down(time.monotonic(), policy, f"it did not start again: {exc}")
                return
            self.started_at = time.monotonic()
            self.restarts += 1
            self.metrics.restarts.labels(backend=self.name).inc()
            self.metrics.up.labels(backend=self.name).set(1)
            log.warning("%s: started again (restart %d, after %s)", self.name, self.restarts, self.last_exit)

    def _down(self, now: float, policy: RestartPolicy, why: str) -> None:
        stable = now - self.started_at >= STABLE_AFTER_S
        self.quick_failures = 0 if stable else self.quick_failures + 1
        delay = policy.delay(self.quick_failures)
        self.last_exit = why
        self.process.proc = None  # reaped and reported once
        self.next_start_at = now + delay
        self.metrics.up.labels(backend=self.name).set(0)
        log.error("backend %s stopped: %s; starting it again in %.1fs", self.name, why, delay)
