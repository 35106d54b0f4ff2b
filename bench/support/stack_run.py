"""The whole stack on this machine for a bench (gateway, scheduler, JetStream,
PostgreSQL, one sampler, one decoder), from ``DARKROOM_*`` values: started on entry
with a client to it, stopped on exit. A helper of the benches that run the stack
(``bench/gpu.py``, ``bench/continuous_stack.py``), not a bench: it has nothing to run, and their
``--smoke`` runs in CI exercise it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self


class BenchStack:
    def __init__(self, env: Mapping[str, str]) -> None:
        from services.config.sections import Settings
        from services.ops.stack import LocalStack

        settings = Settings.from_env({"DARKROOM_GATEWAY_PORT": "0", "DARKROOM_LOG_LEVEL": "WARNING", **env})
        self.stack = LocalStack(settings, cpu_workers=1, decoders=1, durable=False)
        self.client: Any = None

    def __enter__(self) -> Self:
        from tests.helpers import stub

        self.stack.start(timeout=1800)
        self.client = stub(self.stack)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()
