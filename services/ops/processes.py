"""Child processes of the embedded stack (PostgreSQL, nats-server, the services
``darkroom up`` supervises): free ports, waiting for one to listen, running as
another user, and a process that stops on a signal or is killed as a crash would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

# Drops to a user, then execs the command. Popen(user=...) would do the same, but it
# makes CPython fork() rather than vfork(), and a fork() runs gRPC's atfork handlers,
# which can crash the child when another thread is inside gRPC (a test's client, a
# supervisor's gateway) before the child reaches exec.
_EXEC_AS_USER = (
    "import os, pwd, sys\n"
    "user = pwd.getpwnam(sys.argv[1])\n"
    "os.initgroups(user.pw_name, user.pw_gid)\n"
    "os.setgid(user.pw_gid)\n"
    "os.setuid(user.pw_uid)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def as_user(user: str | None, args: list[str]) -> list[str]:
    """``args`` run as ``user`` (unchanged when ``user`` is None), without fork()."""
    if user is None:
        return args
    return [sys.executable, "-I", "-S", "-c", _EXEC_AS_USER, user, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class ManagedProcess:
    """A child process that stops on a signal, or is killed as a crash would kill it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if not self.running:
            return
        assert self.proc is not None
        self.proc.send_signal(self._stop_signal)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL to the whole process group, as a crash of the server would (a
        PostgreSQL postmaster and its backends together): for fault injection."""
        if self.running:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    _stop_signal = signal.SIGTERM
