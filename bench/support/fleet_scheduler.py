"""The scheduler, as ``python -m scheduler`` runs it, with each placement pass timed:
``bench/fleet_load.py`` runs this in place of the scheduler service. The scheduler
has no metric of its pass's duration, so this wraps ``Passes.place`` (the whole
pass: the locked read, the policy, the writes, the events and the dispatches; the
live samplers come from presence's view, kept from NATS) and appends one line per
pass to ``BENCH_PASS_LOG``:

    <unix time at its end> <seconds> <queued jobs it read, -1: none> <live samplers it read> <jobs placed>

A pass that read no queued job (nothing queued, or another replica held the lock)
has -1 for its queued jobs; the harness keeps those apart. Not a benchmark of its
own: ``bench/fleet_load.py --smoke`` runs it in CI."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scheduler import facts
from scheduler import passes as scheduler_passes
from scheduler.service import main as scheduler_main

PASS_LOG = "BENCH_PASS_LOG"


def instrument(path: Path) -> None:
    out = open(path, "a", buffering=1)  # a line at a time: the harness reads it while it runs
    seen: dict[str, int] = {}
    snapshot = facts.fleet_snapshot
    place = scheduler_passes.Passes.place

    live_samplers = scheduler_passes.Passes.live_samplers

    def fleet_snapshot(*args: Any, **kwargs: Any) -> Any:
        seen["queued"] = len(kwargs.get("queued", ()))
        return snapshot(*args, **kwargs)

    def counted_samplers(self: scheduler_passes.Passes) -> Any:
        # The pass's samplers come from presence (NATS), not from a snapshot's rows.
        workers = live_samplers(self)
        seen["workers"] = len(workers)
        return workers

    async def timed_place(self: scheduler_passes.Passes) -> int:
        seen.clear()
        started = time.perf_counter()
        placed = await place(self)
        took = time.perf_counter() - started
        out.write(f"{time.time():.4f} {took:.6f} {seen.get('queued', -1)} {seen.get('workers', -1)} {placed}\n")
        return placed

    facts.fleet_snapshot = fleet_snapshot  # type: ignore[assignment]
    scheduler_passes.Passes.live_samplers = counted_samplers  # type: ignore[method-assign]
    scheduler_passes.Passes.place = timed_place  # type: ignore[method-assign]


if __name__ == "__main__":
    if os.environ.get(PASS_LOG):
        instrument(Path(os.environ[PASS_LOG]))
    scheduler_main()
