"""Many fake samplers in one process, for ``bench/fleet_load.py``: each is the real
sampler service (``gpu_worker.service.serve``: its presence, its JetStream
dispatch consumer, its job store, its events, its gRPC server) with its own worker
id and settings, on the CPU with the ``sim`` model (no tensors worth the name:
the model sleeps its modelled time). Only the process is shared: one event loop,
one interpreter, the kernel's settings.

    python -m bench.support.fleet_host      # run by bench/fleet_load.py as a supervised child

Not a benchmark of its own: ``bench/fleet_load.py --smoke`` runs it in CI.

``BENCH_FLEET_IDS`` names the worker ids (comma-separated); ``BENCH_FLEET_RAMP_S``
spreads their starts over that many seconds (a thousand samplers registering in
the same instant is a thundering herd no real fleet sees). SIGTERM drains them all,
as it drains one. Behind a PgBouncer, the harness sets ``DARKROOM_DATABASE_POOLED``
as an operator would (services/config/sections.py): nothing here is special."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_worker.service import serve
from services.config.sections import KernelSettings
from services.config.workers import SamplerSettings
from services.ops.lifecycle import run_loop
from services.telemetry import logs

IDS = "BENCH_FLEET_IDS"
RAMP = "BENCH_FLEET_RAMP_S"

log = logging.getLogger("bench.support.fleet_host")


async def one(kernel: KernelSettings, settings: SamplerSettings, stop: asyncio.Event, delay_s: float) -> int:
    try:
        await asyncio.wait_for(stop.wait(), delay_s)
        return 0  # stopped before its turn to start
    except TimeoutError:
        pass
    try:
        return await serve(kernel, settings, stop)
    except Exception:
        log.exception("sampler %s failed", settings.worker_id)
        return 1


async def run(ids: list[str], ramp_s: float) -> int:
    kernel = KernelSettings.from_env()
    base = SamplerSettings.from_env()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    step = ramp_s / max(len(ids), 1)
    codes = await asyncio.gather(
        *(one(kernel, dataclasses.replace(base, worker_id=wid), stop, i * step) for i, wid in enumerate(ids))
    )
    failed = [wid for wid, code in zip(ids, codes, strict=True) if code]
    if failed:
        log.error("%d samplers exited non-zero: %s", len(failed), ", ".join(failed[:10]))
    return 1 if failed else 0


def main() -> None:
    ids = [i for i in os.environ.get(IDS, "").split(",") if i]
    if not ids:
        raise SystemExit(f"{IDS} names no worker")
    kernel = KernelSettings.from_env()
    logs.configure(kernel.log_level, service="sampler", fmt=kernel.log_format)
    log.info("%d samplers in process %d", len(ids), os.getpid())
    sys.exit(run_loop(run(ids, float(os.environ.get(RAMP, "0")))))


if __name__ == "__main__":
    main()
