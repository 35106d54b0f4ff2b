"""The leader's watchdog: a rank stuck inside a collective (its process alive, its
supervisor seeing nothing wrong) holds every rank of its group there, the leader's
sampling thread included, while the leader's event loop heartbeats on. So the
leader watches its own step boundaries: a batch across the group that reaches none
for ``stall_after_s``, or for ten of its slowest steps if longer, is stuck, and the
leader exits for its supervisor to re-form the group (``services.ops.group_fate``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from services.ops.lifecycle import EXIT_UNFIT

log = logging.getLogger(__name__)

# A stall is this many of the batch's slowest steps, if that is longer than the floor.
STEPS = 10


class StallWatch:
    """When the running batch last passed a step boundary, and whether it is stuck:
    pure, the clock passed in."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._since: float | None = None  # None: no batch across the group runs
        self._slowest = 0.0

    def began(self, now: float) -> None:
        self._since, self._slowest = now, 0.0

    def boundary(self, now: float) -> None:
        if self._since is not None:
            self._slowest = max(self._slowest, now - self._since)
            self._since = now

    def ended(self) -> None:
        self._since = None

    def stalled(self, now: float) -> float | None:
        """The seconds since the last boundary, if that is a stall; else None."""
        if self._since is None:
            return None
        waited = now - self._since
        return waited if waited > max(self.floor_s, STEPS * self._slowest) else None


def _exit() -> None:
    os._exit(EXIT_UNFIT)


def watch(stall: StallWatch, lock: threading.Lock, stop: threading.Event, on_stall: Callable[[], None] = _exit) -> None:
    """Looks at ``stall`` every second until ``stop``; on a stall, logs and calls
    ``on_stall`` (by default the process exits: no collective can be interrupted)."""
    while not stop.wait(1.0):
        with lock:
            waited = stall.stalled(time.monotonic())
        if waited is not None:
            log.error("a batch across the group reached no step boundary for %.0fs: a rank is stuck; exiting", waited)
            on_stall()
            return
