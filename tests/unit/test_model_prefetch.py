"""The warm planner's prefetch of store models (its decision, pure, and the
prefetcher around it with a stand-in for the host cache), the plan follower
passing over a model still being fetched, and the heartbeat's announcement of
the host cache's blobs, listed again only when the blobs change."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, cast

import pytest

from gpu_worker.engine import SamplerEngine
from gpu_worker.models.model_store import CachedBlobs
from gpu_worker.models.prefetch import Fetching, Prefetcher, Step, next_step
from gpu_worker.plan_follower import follow_plan
from services.db.worker_records import WarmPlan
from services.models.host_cache.layout import Layout
from services.models.registry import ModelRegistry
from tests.store_registry import write_store_registry

A, B = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    path = write_store_registry(tmp_path_factory.mktemp("registry") / "registry.toml", "tiny-store", "tiny-store:7")
    return ModelRegistry.load(path)


def test_the_decision() -> None:
    assert next_step(None, now=0.0) is Step.FETCH
    assert next_step(Fetching(running=True), now=0.0) is Step.WAIT
    assert next_step(Fetching(running=False, succeeded=True), now=0.0) is Step.LOAD
    failed = Fetching(running=False, failed_at=100.0)
    assert next_step(failed, now=110.0, retry_after_s=30.0) is Step.WAIT  # not at every idle call
    assert next_step(failed, now=130.0, retry_after_s=30.0) is Step.FETCH


class Resolves:
    """The host cache's resolve, held until ``done`` is set (or failing)."""

    def __init__(self, *, fail: bool = False) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.done = asyncio.Event()
        self.fail = fail

    async def __call__(self, name: str, version: str | None) -> Path:
        self.calls.append((name, version))
        await self.done.wait()
        if self.fail:
            raise OSError("the store is away")
        return Path("/cache") / name


async def settle(prefetch: Prefetcher) -> None:
    await asyncio.wait_for(asyncio.gather(*prefetch._tasks.values(), return_exceptions=True), 5)


async def test_a_store_model_is_fetched_once_in_the_background_then_ready(registry: ModelRegistry) -> None:
    resolve = Resolves()
    prefetch = Prefetcher(registry, resolve)
    assert prefetch.ready("tiny")  # not from the store: loads as before
    assert not prefetch.ready("tiny-store")
    assert not prefetch.ready("tiny-store")  # one fetch per model, however often asked
    await asyncio.sleep(0)
    assert resolve.calls == [("tiny-store", "7")]
    resolve.done.set()
    await settle(prefetch)
    assert prefetch.ready("tiny-store")
    prefetch.loaded("tiny-store")
    assert not prefetch.ready("tiny-store")  # planned again later: checked on disk again
    await settle(prefetch)
    assert len(resolve.calls) == 2


async def test_a_failed_prefetch_is_logged_and_tried_again_later(
    registry: ModelRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    resolve = Resolves(fail=True)
    resolve.done.set()
    prefetch = Prefetcher(registry, resolve, clock=lambda: now[0], retry_after_s=30.0)
    assert not prefetch.ready("tiny-store")
    await settle(prefetch)
    assert "cannot prefetch tiny-store" in caplog.text
    assert not prefetch.ready("tiny-store")
    await settle(prefetch)
    assert len(resolve.calls) == 1
    now[0] += 31
    assert not prefetch.ready("tiny-store")
    await settle(prefetch)
    assert len(resolve.calls) == 2


async def test_without_a_store_a_store_model_is_loaded_as_before(registry: ModelRegistry) -> None:
    assert Prefetcher(registry, None).ready("tiny-store")


class Engine:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.loaded: list[str] = []

    def warm_models(self) -> list[str]:
        return list(self.loaded)

    def load(self, name: str) -> None:
        self.loaded.append(name)

    def unload(self, name: str) -> None:
        self.loaded.remove(name)


async def test_the_plan_follower_loads_what_is_ready_and_the_store_model_once_fetched(
    registry: ModelRegistry,
) -> None:
    engine = Engine(registry)
    resolve = Resolves()
    prefetch = Prefetcher(registry, resolve)
    plan = WarmPlan("tiny-store", ("tiny-store", "tiny"))

    async def idle() -> None:
        await follow_plan(plan, cast(SamplerEngine, engine), on_drop=lambda name: None, prefetch=prefetch)

    await idle()
    assert engine.loaded == ["tiny"]  # the store model is being fetched: the next one loads
    await idle()
    assert engine.loaded == ["tiny"]  # still fetching: nothing loads, nothing blocks
    resolve.done.set()
    await settle(prefetch)
    await idle()
    assert engine.loaded == ["tiny", "tiny-store"]
    assert resolve.calls == [("tiny-store", "7")]


def test_the_announcement_lists_the_blobs_again_only_when_they_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(tmp_path)
    layout.make()
    blobs = tmp_path / "blobs" / "sha256"
    layout.blob(A).write_bytes(b"a")
    long_ago = time.time_ns() - 60 * 10**9
    os.utime(blobs, ns=(long_ago, long_ago))  # settled
    listed: list[int] = []
    complete_blobs = Layout.complete_blobs

    def counting(self: Layout) -> list[str]:
        listed.append(1)
        return complete_blobs(self)

    monkeypatch.setattr(Layout, "complete_blobs", counting)
    announced = CachedBlobs(layout, "host-1")
    first: dict[str, Any] = announced.telemetry()
    assert first == {"model_cache": {"host": "host-1", "blobs": [A]}}
    assert announced.telemetry() == first
    assert len(listed) == 1  # unchanged: one stat, no listing
    layout.blob(B).write_bytes(b"b")
    assert announced.telemetry()["model_cache"]["blobs"] == [A, B]
    layout.blob(A).unlink()
    assert announced.telemetry()["model_cache"]["blobs"] == [B]
    # Changed just now (within the mtime's tick, another blob may land unseen): listed at each beat.
    announced.telemetry()
    assert len(listed) == 4
    os.utime(blobs, ns=(long_ago, long_ago))
    announced.telemetry()
    announced.telemetry()
    assert len(listed) == 5
