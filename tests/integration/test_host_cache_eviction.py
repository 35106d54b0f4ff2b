"""The host cache's eviction and verification against a real object store
(seaweedfs): past its capacity the least recently used version no sampler holds
goes, a held one stays, the blobs no version links any more are deleted; and
a verification finds a blob corrupted on disk, drops it with the versions linking it,
and the next resolve fetches it again."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.models.host_cache import HostCache
from services.models.host_cache.locks import lock_now
from services.models.host_cache.sources import store_only
from services.models.host_cache.verification import verify, verify_if_due
from services.models.store.objects import ObjectStore
from tests.integration.test_host_cache import MB, assert_model, object_store, pushed

pytestmark = [pytest.mark.integration, pytest.mark.quick]


def blobs_of(store: ObjectStore, name: str) -> set[str]:
    return set(store.read_manifest(name, "1").blobs())


async def test_the_least_recently_used_unheld_version_is_evicted_and_its_blobs_deleted(
    model_store: Any, tmp_path: Path
) -> None:
    store = object_store(model_store)
    (first, first_files), (second, second_files) = pushed(store, tmp_path / "1"), pushed(store, tmp_path / "2")
    # Room for one model (each about 5 MB), not two.
    cache = HostCache(tmp_path / "host", capacity_bytes=8 * MB, manifests=store, sources=store_only(store))
    held = await cache.acquire(first, "1")
    try:
        path = await cache.resolve(second, "1")  # held while it resolves: both stay for now
        assert path.exists()
        # Over capacity: the held version is passed over, the other (unheld now) goes.
        assert await cache.evict() == [f"{second}:1"]
        assert not path.exists()
        assert_model(held.path, first_files)
        on_disk = set(cache.layout.complete_blobs())
        assert blobs_of(store, first) <= on_disk
        assert not blobs_of(store, second) & on_disk  # linked by nothing left: deleted
    finally:
        held.release()
    assert await cache.evict() == []  # within capacity now
    path = await cache.resolve(second, "1")  # the first is unheld and older: it goes
    assert_model(path, second_files)
    assert not cache.layout.model(first, "1").exists()
    assert set(cache.layout.complete_blobs()) == blobs_of(store, second)


async def test_verify_drops_a_corrupt_blob_and_its_version_and_the_next_resolve_fetches_it(
    model_store: Any, tmp_path: Path
) -> None:
    store = object_store(model_store)
    name, files = pushed(store, tmp_path)
    cache = HostCache(tmp_path / "host", capacity_bytes=10**9, manifests=store, sources=store_only(store))
    path = await cache.resolve(name, "1")
    assert (await verify(cache.layout)).corrupt == []
    big = rot(cache)
    found = await verify(cache.layout)
    assert (found.corrupt, found.dropped, found.checked) == ([big], [f"{name}:1"], 2)
    assert not cache.layout.blob(big).exists()
    assert not path.exists()  # a version linking a corrupt blob is never loaded
    fetched = cache.fetched["store"]
    assert_model(await cache.resolve(name, "1"), files)
    # The corrupt blob fetched again (with the version's others that nothing linked
    # once its directory went: the resolve's eviction collects unlinked blobs).
    assert cache.layout.blob(big).stat().st_size <= cache.fetched["store"] - fetched <= fetched
    assert (await verify(cache.layout)).corrupt == []


def rot(cache: HostCache) -> str:
    """Bit rot in the cache's biggest blob, its size unchanged: its digest."""
    big = max(cache.layout.complete_blobs(), key=lambda d: cache.layout.blob(d).stat().st_size)
    fd = os.open(cache.layout.blob(big), os.O_WRONLY)
    try:
        os.pwrite(fd, b"rot", MB)
    finally:
        os.close(fd)
    return big


async def test_darkroom_models_verify_drops_a_rotten_blob_and_says_so(model_store: Any, tmp_path: Path) -> None:
    store = object_store(model_store)
    name, _ = pushed(store, tmp_path)
    cache = HostCache(tmp_path / "host", capacity_bytes=10**9, manifests=store, sources=store_only(store))
    path = await cache.resolve(name, "1")
    big = rot(cache)
    env = {
        **os.environ,
        "DARKROOM_DATA_DIR": str(tmp_path / "data"),
        "DARKROOM_MODEL_CACHE_DIR": str(cache.layout.root),
    }
    command = [sys.executable, "-m", "services.ops.cli", "models", "verify"]
    run = functools.partial(subprocess.run, command, env=env, capture_output=True, text=True, timeout=120)
    found = await asyncio.to_thread(run)
    assert found.returncode == 1, found.stderr
    assert f"corrupt: blob {big}, deleted" in found.stdout and f"dropped {name}:1" in found.stdout
    assert not cache.layout.blob(big).exists() and not path.exists()
    clean = await asyncio.to_thread(run)
    assert clean.returncode == 0 and "checked 1 blobs" in clean.stdout, clean.stdout


async def test_a_sampler_verifies_its_hosts_cache_once_an_interval_one_at_a_time(
    model_store: Any, tmp_path: Path
) -> None:
    store = object_store(model_store)
    name, _ = pushed(store, tmp_path)
    cache = HostCache(tmp_path / "host", capacity_bytes=10**9, manifests=store, sources=store_only(store))
    path = await cache.resolve(name, "1")
    layout, hour = cache.layout, 3600.0
    assert await verify_if_due(layout, hour, now=1000.0) is None  # a new cache: its blobs were checked as they came
    big = rot(cache)
    assert await verify_if_due(layout, hour, now=1000.0 + hour - 1) is None  # not due yet
    other = lock_now(layout.root / "locks" / "verify")  # another sampler of the host verifying
    assert other is not None
    try:
        assert await verify_if_due(layout, hour, now=1000.0 + hour) is None
    finally:
        os.close(other)
    assert layout.blob(big).exists() and path.exists()
    found = await verify_if_due(layout, hour, now=1000.0 + hour)
    assert found is not None and (found.corrupt, found.dropped) == ([big], [f"{name}:1"])
    assert not layout.blob(big).exists() and not path.exists()
    assert await verify_if_due(layout, hour, now=1000.0 + 2 * hour - 1) is None  # the next one an interval on
