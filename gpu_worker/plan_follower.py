"""Following the scheduler's warm plan: between jobs, load what it wants warm here
and drop what it does not. A planned ``store:`` model is prefetched into the
host's cache first (``gpu_worker.models.prefetch``) and loaded from disk once it is there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gpu_worker.engine import SamplerEngine
from gpu_worker.models.prefetch import Prefetcher
from services.db.worker_records import WarmPlan
from services.errors import DarkroomError

log = logging.getLogger(__name__)


async def follow_plan(
    plan: WarmPlan, engine: SamplerEngine, *, on_drop: Callable[[str], None], prefetch: Prefetcher | None = None
) -> None:
    """Loads at most one model per call (a job may be waiting), and drops a model
    only once the plan names others. A store model still being fetched is passed
    over (the next planned one may load meanwhile)."""
    planned = [m for m in plan.models if m in engine.registry]
    if not planned:
        return
    warm = set(engine.warm_models())
    for name in warm - set(planned):
        await asyncio.to_thread(engine.unload, name)
        on_drop(name)
    for name in planned:
        if name in warm:
            continue
        if prefetch is not None and not prefetch.ready(name):
            continue
        try:
            await asyncio.to_thread(engine.load, name)
        except DarkroomError as exc:
            log.warning("cannot preload %s: %s", name, exc)
        finally:
            if prefetch is not None:
                prefetch.loaded(name)
        return
