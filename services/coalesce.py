"""Sharing one round trip among concurrent callers.

``Coalescer``: calls that arrive while one is being carried out wait for it and then
go together, as one call of many items (PgQueuer's batched updates, a database's
group commit). Alone, a call goes at once: it never waits for company, so light load
pays nothing and heavy load pays one round trip per batch.

``SingleFlight``: a read that callers share while it is in flight, for data that may
be as old as the oldest concurrent caller."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    def __init__(self, run_many: Callable[[list[T]], Awaitable[Sequence[R]]], *, max_items: int = 256) -> None:
        """``run_many`` takes items and returns one result per item, in order; an
        exception it raises is every item's."""
        self.run_many = run_many
        self.max_items = max_items
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._runner: asyncio.Task[None] | None = None

    async def __call__(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._runner is None:
            # A context of its own: what its first caller was about (a job, for the
            # logs) is not what the calls it carries are about.
            self._runner = asyncio.create_task(self._run(), context=contextvars.Context())
        return await future

    async def _run(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_items], self._pending[self.max_items :]
                batch = [(item, f) for item, f in batch if not f.cancelled()]
                if not batch:
                    continue
                try:
                    results = await self.run_many([item for item, _ in batch])
                except Exception as exc:
                    if len(batch) == 1:
                        _settle(batch[0][1], exc)
                    else:
                        # One item may have spoiled the call: each goes alone, so
                        # that only its own caller hears of it.
                        for item, future in batch:
                            try:
                                [result] = await self.run_many([item])
                            except Exception as alone:
                                _settle(future, alone)
                            else:
                                _settle(future, result)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    _settle(future, result)
        finally:
            # Reached with no await since the last look at _pending: a call from
            # now on starts a new runner.
            self._runner = None


def _settle(future: asyncio.Future[R], outcome: R | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class SingleFlight(Generic[R]):
    def __init__(self, read: Callable[[], Awaitable[R]]) -> None:
        self.read = read
        self._inflight: asyncio.Future[R] | None = None

    async def __call__(self) -> R:
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self.read())
            self._inflight.add_done_callback(self._landed)
        return await asyncio.shield(self._inflight)

    def _landed(self, future: asyncio.Future[R]) -> None:
        self._inflight = None
        if not future.cancelled():
            future.exception()  # retrieved: its callers got it
