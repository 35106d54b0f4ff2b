"""Keeps child processes running: ``darkroom up`` (the whole stack) and ``darkroom
supervise`` (a GPU host's samplers and decoders) both use it.

A child that exits is restarted after a delay that doubles with each quick failure
(and resets once it has stayed up a while). A child that stops showing it is alive
(it touches a file from its event loop, see ``services.ops.lifecycle``) is hung: it is
sent SIGTERM, then SIGKILL after a grace, and restarted. Each restart is logged
with its reason, and the child is told its restart count, which samplers report
in their heartbeats (``GetStats``)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.config.fields import ENV_PREFIX
from services.ops.forkserver import ForkServer
from services.ops.group_fate import group_of, share_fate
from services.ops.processes import ManagedProcess, dying_with_parent, spawn

log = logging.getLogger(__name__)

# A child that stayed up this long was healthy: its next failure starts the backoff over.
STABLE_AFTER_S = 60.0
# A child starting up (imports, loading models) is not judged hung before it has
# shown itself alive once, or for this long.
STARTUP_GRACE_S = 120.0
POLL_S = 0.2


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    hang_after_s: float = 15.0
    kill_grace_s: float = 5.0

    def delay(self, quick_failures: int) -> float:
        """How long to wait before the next start after this many quick failures in a row."""
        if quick_failures <= 0:
            return 0.0
        return min(self.backoff_s * 2 ** (quick_failures - 1), self.backoff_max_s)


def hung(*, now: float, started_at: float, alive_at: float | None, hang_after_s: float) -> bool:
    """Whether a running child should be killed as hung: it showed itself alive
    once and then fell silent, or never did within the start-up grace."""
    if alive_at is None or alive_at < started_at:
        return now - started_at > max(STARTUP_GRACE_S, hang_after_s)
    return now - alive_at > hang_after_s


class Child(ManagedProcess):
    """One supervised process. ``stop()`` means "stay stopped"; ``kill()`` is a
    crash (SIGKILL), which the supervisor answers with a restart."""

    # A supervisor that dies (SIGKILL, the OOM killer) takes its children with it,
    # as a crash of the box would: no orphan serves on, and the next start finds
    # its ports and its backends free. Nobody is left to escalate a stop, so SIGKILL.
    _death_signal = signal.SIGKILL

    def __init__(
        self,
        name: str,
        module: str,
        env: dict[str, str],
        log_path: Path,
        liveness_path: Path | None,
        *,
        service: str = "",
    ) -> None:
        super().__init__()
        self.name = name
        self.module = module
        # What it is, in logs, metrics and the CLI (its module, unless said).
        self.service = service or module
        self.env = env
        self.log_path = log_path
        self.liveness_path = liveness_path
        self.wanted = False
        self.restarts = 0
        self.quick_failures = 0
        self.started_at = 0.0
        self.next_start_at = 0.0
        self.last_exit: str | None = None
        # Every process it has started: none may outlive the supervisor.
        self.pids: list[int] = []
        self.lock = threading.RLock()
        # Where it is forked from, when its host has a fork server (Supervisor.add).
        self.forks: ForkServer | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    def start(self) -> None:
        """Starts it (if it is not running) and keeps it running from now on."""
        with self.lock:
            self.wanted = True
            if self.running:
                return
            self._spawn()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.env, f"{ENV_PREFIX}RESTARTS": str(self.restarts), "PYTHONUNBUFFERED": "1"}
        if self.liveness_path is not None:
            self.liveness_path.parent.mkdir(parents=True, exist_ok=True)
            self.liveness_path.unlink(missing_ok=True)
            env[f"{ENV_PREFIX}LIVENESS_FILE"] = str(self.liveness_path)
        if self.forks is not None and self.forks.compatible(env):
            self.proc = self.forks.fork(self.module, env, self.log_path)
        else:
            with open(self.log_path, "ab") as out:
                self.proc = spawn(
                    dying_with_parent([sys.executable, "-m", self.module], self._death_signal),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        self.pids.append(self.proc.pid)
        self.started_at = time.monotonic()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; it stays stopped until ``start()``."""
        with self.lock:
            self.wanted = False
            super().stop(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would: the supervisor restarts it."""
        with self.lock:
            super().kill()

    def signal(self, sig: signal.Signals) -> None:
        with self.lock:
            if self.running:
                assert self.proc is not None
                self.proc.send_signal(sig)

    def alive_at(self) -> float | None:
        """When it last showed itself alive, on the monotonic clock."""
        if self.liveness_path is None:
            return None
        try:
            age = time.time() - self.liveness_path.stat().st_mtime
        except OSError:
            return None
        return time.monotonic() - age

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Watched(Protocol):
    """Something else the supervisor looks at on each poll (a backend of ``darkroom
    up``: services.ops.backends)."""

    name: str

    def check(self, now: float, policy: RestartPolicy) -> None: ...


class Supervisor:
    def __init__(self, policy: RestartPolicy, *, forks: Mapping[str, ForkServer] | None = None) -> None:
        self.policy = policy
        # Where each service is forked from (children.fork_servers); one not in it is a new process.
        self.forks = dict(forks or {})
        self.children: dict[str, Child] = {}
        self.watched: dict[str, Watched] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, child: Child, *, start: bool = True) -> Child:
        self.children[child.name] = child
        child.forks = self.forks.get(child.service)
        if start:
            child.start()
        return child

    def watch(self, watched: Watched) -> Watched:
        self.watched[watched.name] = watched
        return watched

    def check(self, now: float | None = None) -> None:
        """One look at every child: restart what exited, kill what hangs. What
        it watches besides (backends, which the children need) is looked at first."""
        now = time.monotonic() if now is None else now
        for watched in list(self.watched.values()):
            if self._stopping.is_set():
                return
            watched.check(now, self.policy)
        broken: list[str] = []
        for child in list(self.children.values()):
            with child.lock:
                if not child.wanted or self._stopping.is_set():
                    continue
                if child.running:
                    if child.liveness_path is not None and hung(
                        now=now,
                        started_at=child.started_at,
                        alive_at=child.alive_at(),
                        hang_after_s=self.policy.hang_after_s,
                    ):
                        log.error(
                            "%s (pid %d) shows no sign of life for %.0fs: killing it",
                            child.name,
                            child.proc.pid if child.proc else -1,
                            self.policy.hang_after_s,
                        )
                        ManagedProcess.stop(child, self.policy.kill_grace_s)
                        self._exited(child, now, "it hung")
                        broken.append(child.name)
                    continue
                if child.proc is not None:
                    code = child.proc.returncode
                    self._exited(child, now, f"it exited with {describe_exit(code)}")
                    broken.append(child.name)
                    if group_of(child) is not None:
                        continue  # restarted with its group, at the group's time (share_fate)
                if now >= child.next_start_at:
                    child.restarts += 1
                    log.warning("%s: restart %d (%s)", child.name, child.restarts, child.last_exit)
                    child._spawn()

        share_fate(self.children, broken, self.policy.kill_grace_s)

    def _exited(self, child: Child, now: float, why: str) -> None:
        stable = now - child.started_at >= STABLE_AFTER_S
        child.quick_failures = 0 if stable else child.quick_failures + 1
        delay = self.policy.delay(child.quick_failures)
        child.last_exit = why
        child.proc = None
        child.next_start_at = now + delay
        log.warning("%s stopped: %s; restarting in %.1fs", child.name, why, delay)

    def start(self) -> None:
        """Watches the children from a thread until ``stop()``."""

        def watch() -> None:
            while not self._stopping.wait(POLL_S):
                try:
                    self.check()
                except Exception:  # a supervisor that dies supervises nothing
                    log.exception("supervisor check failed")

        self._thread = threading.Thread(target=watch, name="darkroom-supervisor", daemon=True)
        self._thread.start()

    def stop(self, order: Sequence[str] = (), *, timeout: float = 15.0) -> None:
        """Stops watching, then stops the children: those in ``order`` first, in
        that order, then the rest; each gets ``timeout`` to exit before SIGKILL."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        names = [n for n in order if n in self.children] + [n for n in self.children if n not in order]
        for name in names:
            self.children[name].stop(timeout)


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
