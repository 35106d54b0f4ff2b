"""A managed process killed or stopped while the watcher that saw it exit (a
backend's supervisor, from its own thread) clears its handle is still signalled and
reaped: the handle is read once. A real child each time."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import pytest

from services.ops.processes import ManagedProcess


def cleared_on(managed: ManagedProcess, real: Callable[..., None]) -> Callable[..., None]:
    """``real`` (a signal's sender), after which the handle is gone, as the watcher would leave it."""

    def send(*args: object) -> None:
        real(*args)
        managed.proc = None

    return send


def test_a_process_whose_handle_is_cleared_mid_kill_is_killed_and_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    managed = ManagedProcess()
    child = managed.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    monkeypatch.setattr(os, "killpg", cleared_on(managed, os.killpg))
    managed.kill()
    assert child.returncode == -signal.SIGKILL


def test_a_process_whose_handle_is_cleared_mid_stop_is_stopped_and_reaped() -> None:
    managed = ManagedProcess()
    child = managed.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    child.send_signal = cleared_on(managed, child.send_signal)  # type: ignore[method-assign]
    managed.stop(timeout=10)
    assert child.returncode == -signal.SIGTERM
