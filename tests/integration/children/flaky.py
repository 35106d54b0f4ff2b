"""A child for supervisor tests. ``FLAKY_MODE``: ``exit`` exits with code 7 until its
``FLAKY_COUNTER`` file holds ``FLAKY_EXITS`` starts, then runs; ``hang`` stops
touching its liveness file after a second and ignores SIGTERM (a wedged process)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    counter = Path(os.environ["FLAKY_COUNTER"])
    starts = int(counter.read_text()) + 1 if counter.exists() else 1
    # Written whole (a rename), never seen half-written by the test reading it.
    written = counter.with_name(counter.name + ".new")
    written.write_text(str(starts))
    written.replace(counter)
    Path(os.environ["FLAKY_COUNTER"] + f".restarts{starts}").write_text(os.environ.get("DARKROOM_RESTARTS", "?"))
    alive = Path(os.environ["DARKROOM_LIVENESS_FILE"])
    mode = os.environ["FLAKY_MODE"]
    if mode == "exit" and starts <= int(os.environ["FLAKY_EXITS"]):
        sys.exit(7)
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    began = time.monotonic()
    while True:
        if mode != "hang" or time.monotonic() - began < 1.0:
            alive.touch()
        time.sleep(0.1)


if __name__ == "__main__":
    main()
