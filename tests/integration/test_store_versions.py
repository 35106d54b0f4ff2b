"""What a host's cache serves after the store changes under it, against a real S3
server (seaweedfs): a version pushed again with other bytes of the same sizes is
refused unless forced, and a forced one is what every host then loads; a version
removed from the store is gone from the hosts that cached it, while a store that
cannot be reached still leaves them the copy they kept; and a sampler that holds
such a version in memory loads it afresh, or fails, at its next use."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.engine import SamplerEngine
from gpu_worker.models.model_store import stale_models
from services.config.model_store import ModelStoreSettings
from services.errors import ModelError
from services.models.host_cache import HostCache, loading
from services.models.host_cache.sources import store_only
from services.models.registry import ModelRegistry
from services.models.store.errors import ModelNotInStore, ModelStoreError
from services.models.store.objects import ObjectStore
from services.models.store.push import push_directory
from services.ops.processes import free_port
from tests.integration.test_model_store import darkroom
from tests.store_registry import write_store_registry

# In the quick tier (pytest -m "not slow": docs/contributing.md).
pytestmark = pytest.mark.quick


def client(model_store: Any, **env: str) -> ObjectStore:
    return ObjectStore.from_settings(ModelStoreSettings.from_env({**model_store.env(), **env}))


def write_model(root: Path, weights: bytes) -> Path:
    (root / "unet").mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_bytes(b'{"_class_name": "Test"}')
    (root / "unet" / "w.bin").write_bytes(weights)
    return root


def cache_of(root: Path, store: ObjectStore) -> HostCache:
    return HostCache(root, capacity_bytes=10**9, manifests=store, sources=store_only(store))


async def test_a_version_pushed_again_with_other_bytes_is_refused_unless_forced_then_served_everywhere(
    model_store: Any, tmp_path: Path
) -> None:
    store = client(model_store)
    name = f"finetune{uuid.uuid4().hex[:6]}"
    v1 = b"weights-v1" * 10_000
    v2 = b"weights-v2" * 10_000  # a fine-tune: every file of the same size
    first = push_directory(store, write_model(tmp_path / "v1", v1), f"{name}:prod")
    host = cache_of(tmp_path / "host", store)
    assert (await host.resolve(name, "prod") / "unet" / "w.bin").read_bytes() == v1

    with pytest.raises(ModelError, match=rf"{name}:prod is already in the store with other content.*--force"):
        push_directory(store, write_model(tmp_path / "v2", v2), f"{name}:prod")
    assert store.read_manifest(name, "prod") == first.manifest  # nothing moved
    assert push_directory(store, tmp_path / "v1", f"{name}:prod").uploaded == {}  # the same bytes: a no-op

    forced = push_directory(store, tmp_path / "v2", f"{name}:prod", force=True)
    assert store.read_manifest(name, "prod").digest == forced.manifest.digest != first.manifest.digest
    new_blob = next(f.digest for f in forced.manifest.files if f.path == "unet/w.bin")

    held = await host.acquire(name, "prod")
    try:
        weights = held.path / "unet" / "w.bin"
        assert weights.read_bytes() == v2
        assert weights.stat().st_ino == host.layout.blob(new_blob).stat().st_ino  # the new blob, kept
    finally:
        held.release()
    fetched = host.fetched["store"]
    assert (await host.resolve(name, None) / "unet" / "w.bin").read_bytes() == v2
    await host.evict()
    assert host.layout.blob(new_blob).exists()
    assert (await host.resolve(name, "prod") / "unet" / "w.bin").read_bytes() == v2
    assert host.fetched["store"] == fetched  # fetched once, not at every load


def test_the_cli_refuses_to_replace_a_version_without_force(model_store: Any, tmp_path: Path) -> None:
    env = {**os.environ, **model_store.env(), "DARKROOM_DATA_DIR": str(tmp_path / "data")}
    name = f"cli{uuid.uuid4().hex[:6]}"
    assert darkroom(env, "push", str(write_model(tmp_path / "a", b"a" * 1000)), f"{name}:1").returncode == 0
    refused = darkroom(env, "push", str(write_model(tmp_path / "b", b"b" * 1000)), f"{name}:1")
    assert refused.returncode == 1 and "--force" in refused.stderr, refused.stderr
    forced = darkroom(env, "push", "--force", str(tmp_path / "b"), f"{name}:1")
    assert forced.returncode == 0, forced.stderr
    assert "replaced" in forced.stdout
    weights = client(model_store).read_manifest(name, "1").files[1]
    assert (weights.path, weights.digest) == ("unet/w.bin", hashlib.sha256(b"b" * 1000).hexdigest())


async def test_a_version_removed_from_the_store_is_gone_from_a_host_that_cached_it(
    model_store: Any, tmp_path: Path
) -> None:
    store = client(model_store)
    name = f"withdrawn{uuid.uuid4().hex[:6]}"
    pushed = push_directory(store, write_model(tmp_path / "m", b"bad weights" * 1000), f"{name}:1")
    host = cache_of(tmp_path / "host", store)
    model_dir = await host.resolve(name, None)  # by "latest", as a registry's `store:NAME` does
    store.remove(name)

    for version in (None, "1"):
        with pytest.raises(ModelNotInStore):
            await host.resolve(name, version)
    assert not model_dir.exists()
    assert not host.layout.manifest(name, "1").exists() and not host.layout.latest(name).exists()
    await host.evict()
    assert not any(host.layout.blob(d).exists() for d in pushed.manifest.blobs())  # what peers were offered


async def test_a_store_that_cannot_be_reached_leaves_a_host_its_kept_copy(model_store: Any, tmp_path: Path) -> None:
    store = client(model_store)
    name = f"kept{uuid.uuid4().hex[:6]}"
    push_directory(store, write_model(tmp_path / "m", b"kept" * 1000), f"{name}:1")
    model_dir = await cache_of(tmp_path / "host", store).resolve(name, None)
    away = client(model_store, DARKROOM_MODEL_STORE_URL=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ModelStoreError):
        away.read_manifest(name, None)
    assert await cache_of(tmp_path / "host", away).resolve(name, None) == model_dir
    assert await cache_of(tmp_path / "host", away).resolve(name, "1") == model_dir


async def test_a_loaded_model_whose_version_changed_in_the_store_is_loaded_afresh(
    model_store: Any, models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampler holding a version in memory: pushed again with other content (forced),
    its next use loads the new content; removed, its next use fails, not serves it."""
    store = client(model_store)
    name = f"served{uuid.uuid4().hex[:6]}"
    first = push_directory(store, models_dir / "tiny", f"{name}:prod")
    registry = ModelRegistry.load(write_store_registry(tmp_path / "registry.toml", "served", f"{name}:prod"))
    cache = cache_of(tmp_path / "host", store)
    monkeypatch.setattr(loading, "_installed", None)  # put back after: the installed cache is the process's
    loading.install(cache, asyncio.get_running_loop())
    engine = SamplerEngine(registry, models_dir, torch.device("cpu"))
    try:
        before = await asyncio.to_thread(engine.load, "served")
        assert await stale_models(cache, loading.held()) == set()

        changed = tmp_path / "retrained"
        shutil.copytree(models_dir / "tiny", changed)
        with (changed / "model_index.json").open("a") as f:
            f.write("\n")  # other content, the same model
        second = push_directory(store, changed, f"{name}:prod", force=True)
        stale = await stale_models(cache, loading.held())
        assert stale == {"served"}
        assert engine.takes_joiners("served")
        engine.mark_stale(stale)
        assert engine.warm_models() == []  # placement sees it as cold: its next use loads it
        assert not engine.takes_joiners("served")  # a batch running it ends with its members
        after = await asyncio.to_thread(engine.load, "served")
        assert after is not before and engine.warm_models() == ["served"] and engine.takes_joiners("served")
        assert loading.held()["served"].digest == second.manifest.digest != first.manifest.digest
        assert await stale_models(cache, loading.held()) == set()

        store.remove(name)
        engine.mark_stale(await stale_models(cache, loading.held()))
        with pytest.raises(ModelError, match="not in the model store"):
            await asyncio.to_thread(engine.load, "served")
        assert engine.warm_models() == []
    finally:
        for model in engine.warm_models():
            await asyncio.to_thread(engine.unload, model)
