"""A child for the fork server's tests: writes what it is (its pid, parent,
session, argv, name, ``DARKROOM_TEST_WORD`` and torch's thread count when the
server imported torch) to ``DARKROOM_TEST_REPORT``, prints a line, then exits with
``DARKROOM_TEST_EXIT`` or, when that is empty, sleeps until it is signalled."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    report = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "argv0": sys.argv[0],
        "name": __name__,
        "word": os.environ.get("DARKROOM_TEST_WORD"),
        "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
    }
    written = Path(os.environ["DARKROOM_TEST_REPORT"] + ".new")
    written.write_text(json.dumps(report))
    written.replace(os.environ["DARKROOM_TEST_REPORT"])
    print(f"forked child {os.getpid()} says {report['word']}", flush=True)
    if os.environ.get("DARKROOM_TEST_EXIT"):
        sys.exit(int(os.environ["DARKROOM_TEST_EXIT"]))
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    main()
