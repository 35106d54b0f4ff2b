"""Sharing a round trip among concurrent callers: calls that arrive while one is
carried out go together; alone, a call goes at once; one bad item fails alone."""

from __future__ import annotations

import asyncio

import pytest

from services.coalesce import Coalescer, SingleFlight


class Store:
    """Records each call of many items; fails for the item "bad"."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def run_many(self, items: list[str]) -> list[str]:
        self.calls.append(items)
        await self.release.wait()
        if "bad" in items:
            raise ValueError("bad item")
        return [item.upper() for item in items]


async def test_a_lone_call_goes_at_once() -> None:
    store = Store()
    assert await Coalescer(store.run_many)("a") == "A"
    assert store.calls == [["a"]]


async def test_calls_arriving_while_one_is_carried_out_go_together() -> None:
    store = Store()
    coalesce = Coalescer(store.run_many)
    store.release.clear()
    first = asyncio.ensure_future(coalesce("a"))
    await asyncio.sleep(0)  # the first call is under way
    await asyncio.sleep(0)
    later = [asyncio.ensure_future(coalesce(x)) for x in ("b", "c", "d")]
    await asyncio.sleep(0)
    store.release.set()
    assert await asyncio.gather(first, *later) == ["A", "B", "C", "D"]
    assert store.calls == [["a"], ["b", "c", "d"]]


async def test_batches_are_at_most_max_items() -> None:
    store = Store()
    coalesce = Coalescer(store.run_many, max_items=2)
    assert await asyncio.gather(*(coalesce(x) for x in "abcde")) == list("ABCDE")
    assert [len(c) for c in store.calls] == [2, 2, 1]


async def test_one_bad_item_fails_alone() -> None:
    store = Store()
    coalesce = Coalescer(store.run_many)
    results = await asyncio.gather(coalesce("a"), coalesce("bad"), coalesce("c"), return_exceptions=True)
    assert results[0] == "A" and results[2] == "C"
    assert isinstance(results[1], ValueError)
    # Tried together once, then each alone: only its own caller heard of the failure.
    assert store.calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]


async def test_a_single_flight_read_is_shared_by_callers_while_in_flight() -> None:
    reads = 0
    gate = asyncio.Event()

    async def read() -> int:
        nonlocal reads
        reads += 1
        await gate.wait()
        return reads

    shared = SingleFlight(read)
    waiting = [asyncio.ensure_future(shared()) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*waiting) == [1, 1, 1]
    assert await shared() == 2  # once landed, the next caller reads afresh


async def test_a_single_flight_failure_reaches_every_caller_and_the_next_read_tries_again() -> None:
    calls = 0

    async def read() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("away")
        return calls

    shared = SingleFlight(read)
    with pytest.raises(ConnectionError):
        await shared()
    assert await shared() == 2
