"""A service for the tracing tests: under ``run_service``, with the export delay it is
given, it emits one span for job ``TRACED_JOB_ID``, creates ``TRACED_READY`` and waits
for SIGTERM. The span must reach the collector before the process exits."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gateway import spans as gateway_spans
from gpu_worker import spans as sampler_spans
from services.config.sections import KernelSettings, SchedulerSettings
from services.db.records import NewJob
from services.generation import GenerationParams
from services.ops.lifecycle import run_service


async def serve(kernel: KernelSettings, settings: SchedulerSettings, stop: asyncio.Event) -> int:
    job_id = os.environ["TRACED_JOB_ID"]
    params = GenerationParams("tiny", "p", "", 64, 64, 1, 7.5, 1, 1)
    new = gateway_spans.with_trace(NewJob(job_id, "free", 0, params, None))
    job: Any = SimpleNamespace(id=job_id, attempt=1, trace_context=new.trace_context)
    with sampler_spans.decode_call([job], "decoder-0"):
        pass
    await asyncio.to_thread(Path(os.environ["TRACED_READY"]).touch)
    await stop.wait()
    return 0


if __name__ == "__main__":
    run_service("scheduler", serve, SchedulerSettings)
