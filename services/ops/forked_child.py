"""A fork server's child as its supervisor sees it (``ForkedProcess``: what the
supervisor uses of ``subprocess.Popen``), and what the server reads of a process
from ``/proc``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time


class ForkedProcess:
    """A child of the fork server, as the supervisor sees it: ``subprocess.Popen``'s
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and
    ``kill``. Its exit is reported by the server (it is the server's to reap)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def wait_gone(pid: int, timeout: float) -> None:
    """Until ``pid`` is gone or a zombie: its exit seen by the kernel."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and _state(pid) not in ("Z", "X"):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(f"pid {pid}", timeout)
        time.sleep(0.02)


def _state(pid: int) -> str:
    fields = proc_stat(pid)
    return fields[0] if fields else "X"


def proc_stat(pid: int) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the process's name (its state first); none when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []
