"""Prefetching what the warm plan names from the model store: a planned ``store:``
model is fetched into the host's cache in the background (the consumer is never
held up by a download), and loaded only once it is on disk, at a later idle call,
so that the load is a cache hit and a job that arrives meanwhile is not kept
waiting behind the fetch."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.models.registry import ModelRegistry
from services.models.spec import store_reference

log = logging.getLogger(__name__)

# A failed prefetch (the store away, no such version) is tried again after this long,
# not at every idle call.
RETRY_AFTER_S = 30.0

Resolve = Callable[[str, str | None], Awaitable[object]]


class Step(enum.Enum):
    FETCH = "fetch"  # start fetching it in the background
    WAIT = "wait"  # being fetched, or failed a moment ago: not now
    LOAD = "load"  # on disk (or not from the store): load it


@dataclass(frozen=True)
class Fetching:
    """What this process knows of a model's prefetch."""

    running: bool
    succeeded: bool = False
    failed_at: float | None = None


def next_step(fetching: Fetching | None, *, now: float, retry_after_s: float = RETRY_AFTER_S) -> Step:
    if fetching is None:
        return Step.FETCH
    if fetching.running:
        return Step.WAIT
    if fetching.succeeded:
        return Step.LOAD
    if fetching.failed_at is not None and now - fetching.failed_at >= retry_after_s:
        return Step.FETCH
    return Step.WAIT


class Prefetcher:
    """At most one background fetch per model; ``resolve`` is the host cache's
    (``HostCache.resolve``), None where there is no store (everything loads as before)."""

    def __init__(
        self,
        registry: ModelRegistry,
        resolve: Resolve | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self.registry = registry
        self.resolve = resolve
        self.clock = clock
        self.retry_after_s = retry_after_s
        self._tasks: dict[str, asyncio.Task[bool]] = {}
        self._failed_at: dict[str, float] = {}

    def ready(self, model: str) -> bool:
        """Whether ``model`` may be loaded now; a store model not yet fetched starts fetching."""
        stored = store_reference(self.registry.get(model))
        if stored is None or self.resolve is None:
            return True
        step = next_step(self._fetching(model), now=self.clock(), retry_after_s=self.retry_after_s)
        if step is Step.FETCH:
            self._tasks[model] = asyncio.create_task(self._fetch(model, *stored), name=f"prefetch {model}")
        return step is Step.LOAD

    def loaded(self, model: str) -> None:
        """Loaded (or tried): the next time the plan names it, it is checked on disk again
        (it may have been evicted since it was dropped)."""
        self._tasks.pop(model, None)
        self._failed_at.pop(model, None)

    def _fetching(self, model: str) -> Fetching | None:
        task = self._tasks.get(model)
        if task is None:
            return None
        if not task.done():
            return Fetching(running=True)
        if not task.cancelled() and task.result():
            return Fetching(running=False, succeeded=True)
        return Fetching(running=False, failed_at=self._failed_at.get(model, self.clock()))

    async def _fetch(self, model: str, name: str, version: str | None) -> bool:
        assert self.resolve is not None
        started = self.clock()
        try:
            await self.resolve(name, version)
        except Exception as exc:  # logged, never raised: the plan is followed on
            self._failed_at[model] = self.clock()
            log.warning("cannot prefetch %s (store:%s:%s): %s", model, name, version or "latest", exc)
            return False
        log.info("prefetched %s into the host's model cache in %.2fs", model, self.clock() - started)
        return True

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
