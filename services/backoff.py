"""Waiting between retries of something that is away: doubling delays, capped."""

from __future__ import annotations

import asyncio
import contextlib


class Backoff:
    def __init__(self, first_s: float = 0.2, max_s: float = 5.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.next_s = first_s

    def delay(self) -> float:
        """The next delay; the one after it is twice as long, up to ``max_s``."""
        delay, self.next_s = self.next_s, min(self.next_s * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.next_s = self.first_s

    async def wait(self, stop: asyncio.Event | None = None) -> None:
        """Sleeps the next delay, or less if ``stop`` is set meanwhile."""
        delay = self.delay()
        if stop is None:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
