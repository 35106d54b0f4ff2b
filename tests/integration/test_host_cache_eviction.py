"""The host cache's eviction and verification against a real object store
(seaweedfs): past its capacity the least recently used version no sampler holds
goes, a held one stays, the blobs no version links any more are deleted; and
``verify`` finds a blob corrupted on disk, drops it with the versions linking it,
and the next resolve fetches it again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from services.models.host_cache import HostCache
from services.models.host_cache.sources import store_only
from services.models.store.objects import ObjectStore
from tests.integration.test_host_cache import MB, assert_model, object_store, pushed

pytestmark = pytest.mark.integration


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
    assert await cache.verify() == []
    big = max(cache.layout.complete_blobs(), key=lambda d: cache.layout.blob(d).stat().st_size)
    fd = os.open(cache.layout.blob(big), os.O_WRONLY)
    try:
        os.pwrite(fd, b"rot", MB)  # bit rot on the disk, same size
    finally:
        os.close(fd)
    assert await cache.verify() == [big]
    assert not cache.layout.blob(big).exists()
    assert not path.exists()  # a version linking a corrupt blob is never loaded
    fetched = cache.fetched["store"]
    assert_model(await cache.resolve(name, "1"), files)
    # The corrupt blob fetched again (with the version's others that nothing linked
    # once its directory went: the resolve's eviction collects unlinked blobs).
    assert cache.layout.blob(big).stat().st_size <= cache.fetched["store"] - fetched <= fetched
    assert await cache.verify() == []
