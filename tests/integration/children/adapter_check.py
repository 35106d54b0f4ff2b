"""A stand-in for the adapter check (services.models.adapters.checking): its request
file says how it ends: ``answer`` printed, or killed by ``signal`` (by ``crash_once``
the first time only), or ``exit`` with that code and nothing printed."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def main() -> None:
    asked = Path(sys.argv[1])
    request = json.loads(asked.read_text())
    crashed = asked.with_suffix(".crashed")
    if "crash_once" in request and not crashed.exists():
        crashed.touch()
        os.kill(os.getpid(), getattr(signal, request["crash_once"]))
    if "signal" in request:
        os.kill(os.getpid(), getattr(signal, request["signal"]))
    if "answer" in request:
        print(json.dumps(request["answer"]))
    sys.exit(request.get("exit", 0))


if __name__ == "__main__":
    main()
