"""Child processes of the embedded stack (PostgreSQL, nats-server, the services
``darkroom up`` supervises): free ports, waiting for one to listen, running as
another user, dying with the parent, and a process that stops on a signal or is
killed as a crash would."""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Protocol

# Drops to a user (if one is named), asks the kernel for a signal when the parent
# dies (PR_SET_PDEATHSIG, if a signal is named), then execs the command, so that the
# pid the parent holds is the command's own. Popen(user=...) or a preexec_fn would
# do the same, but they make CPython fork() rather than vfork(), and a fork() runs
# gRPC's atfork handlers, which can crash the child when another thread is inside
# gRPC (a test's client, a supervisor's gateway) before the child reaches exec.
# The signal is asked for after the switch: a change of credentials clears it. A
# parent that died before it was asked for is noticed by the parent pid changing.
_EXEC_AS = (
    "import os, sys\n"
    "user, parent, sig = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
    "if sig:\n"
    "    import ctypes\n"  # before the switch: the user may not read Python's library
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "if user:\n"
    "    import pwd\n"
    "    entry = pwd.getpwnam(user)\n"
    "    os.initgroups(entry.pw_name, entry.pw_gid)\n"
    "    os.setgid(entry.pw_gid)\n"
    "    os.setuid(entry.pw_uid)\n"
    "if sig:\n"
    "    if libc.prctl(1, sig, 0, 0, 0) != 0:\n"  # 1: PR_SET_PDEATHSIG
    "        raise OSError(ctypes.get_errno(), 'prctl(PR_SET_PDEATHSIG)')\n"
    "    if os.getppid() != parent:\n"
    "        sys.exit(f'{sys.argv[4]}: its parent {parent} died before it started')\n"
    "os.execv(sys.argv[4], sys.argv[4:])\n"
)
# Only Linux has PR_SET_PDEATHSIG.
_PDEATHSIG = sys.platform == "linux"


def as_user(user: str | None, args: list[str], *, death_signal: signal.Signals | None = None) -> list[str]:
    """``args`` run as ``user`` (unchanged when ``user`` is None) and sent
    ``death_signal`` when the thread that starts them dies (see ``spawn``), without
    fork(); unchanged when there is neither."""
    sig = int(death_signal) if death_signal is not None and _PDEATHSIG else 0
    if user is None and not sig:
        return args
    return [sys.executable, "-I", "-S", "-c", _EXEC_AS, user or "", str(os.getpid()), str(sig), *args]


# What a backend (PostgreSQL, nats-server, PgBouncer) is given of this process's
# environment: where programs are, the locale and time zone (PostgreSQL's initdb and
# messages read them), nothing else. `darkroom up` may hold DARKROOM_API_KEYS or the
# model store writer's keys in its environment; a backend reads none of them, and
# what it holds its user can read in /proc/<pid>/environ.
_BACKEND_VARIABLES = frozenset({"PATH", "LANG", "LANGUAGE", "TZ"})


def backend_env() -> dict[str, str]:
    """This process's PATH, locale (LANG, LANGUAGE, LC_*) and TZ, for a backend's
    process; PATH the system's where this process has none."""
    env = {k: v for k, v in os.environ.items() if k in _BACKEND_VARIABLES or k.startswith("LC_")}
    env.setdefault("PATH", "/usr/bin:/bin")
    return env


def dying_with_parent(args: list[str], death_signal: signal.Signals = signal.SIGKILL) -> list[str]:
    """``args``, sent ``death_signal`` when their parent dies."""
    return as_user(None, args, death_signal=death_signal)


class _Spawner:
    """Starts processes from one thread that lives as long as this process. The
    kernel sends a child's parent-death signal when the *thread* that started it
    ends, not the process: a child a short-lived thread started (a supervisor's
    watch, a test's helper) would be killed with that thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[tuple[Future[subprocess.Popen[bytes]], list[str], dict[str, Any]]]
        self._requests = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        if threading.current_thread() is self._thread:
            return subprocess.Popen(args, **kwargs)
        with self._lock:
            if self._thread is None or self._pid != os.getpid():  # none yet, or a fork() lost it
                self._requests = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, name="darkroom-spawner", daemon=True)
                self._pid = os.getpid()
                self._thread.start()
            requests = self._requests
        started: Future[subprocess.Popen[bytes]] = Future()
        requests.put((started, args, kwargs))
        return started.result()

    def _serve(self) -> None:
        requests = self._requests
        while True:
            started, args, kwargs = requests.get()
            try:
                started.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as exc:  # the caller's to raise
                started.set_exception(exc)


_SPAWNER = _Spawner()


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, **kwargs)``, from the thread that outlives every
    other here: for children given a parent-death signal (``as_user``,
    ``dying_with_parent``)."""
    return _SPAWNER.popen(args, **kwargs)


# Where free ports are looked for: below the kernel's ephemeral range. A port the
# kernel hands out for port 0 comes from that range, which is also where outgoing
# connections take their source ports, so one may take it (and keep it, a
# long-lived connection) before the service it was picked for binds it.
_LOWEST_PORT = 10000


# Every port free_port() has handed out in this process. A stack picks all its
# ports (gateway, HTTP, each child's metrics) before any child binds one, so a
# port that is merely unbound can already be another child's: handing it out
# twice made two children fight over one port (the loser restarting forever and
# a client reaching the winner, a metrics server that answers 405).
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on or connects from now, outside the
    ephemeral range where the kernel can, and never one this process has handed out
    before; a kernel-picked one where no room is left below that range."""
    first_ephemeral = _ephemeral_ports()[0]
    with _HANDED_OUT_LOCK:
        for _ in range(256):
            if first_ephemeral <= _LOWEST_PORT:
                break
            port = _LOWEST_PORT + secrets.randbelow(first_ephemeral - _LOWEST_PORT)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue  # in use: another
            _HANDED_OUT.add(port)
            return port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _HANDED_OUT.add(port)
        return port


def _ephemeral_ports() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(n) for n in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def wait_for_port(port: int, *, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


class Process(Protocol):
    """What ``ManagedProcess`` uses of a process: ``subprocess.Popen``'s, or a
    fork server's child (services.ops.forkserver.ForkedProcess)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class ManagedProcess:
    """A child process that stops on a signal, or is killed as a crash would kill it.
    Its ``_death_signal`` is what it gets when the process that started it dies
    (``as_user``, ``spawn``): by default its stop signal, a clean stop nobody waits for."""

    def __init__(self) -> None:
        self.proc: Process | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # Both hold the process they act on: a watcher that sees it exit (a backend's
    # supervisor) may clear ``proc`` from its own thread meanwhile.
    def stop(self, timeout: float = 15.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(self._stop_signal)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL to the whole process group, as a crash of the server would (a
        PostgreSQL postmaster and its backends together): for fault injection."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    _stop_signal = signal.SIGTERM
    _death_signal = signal.SIGTERM
