"""Loading a ``store:`` model: ``resolve_source`` asks here for its directory in the
host cache (fetched first if needed). Loads run in a worker thread: a sampler
installs its cache (with its peers and leases, on its event loop) and the
resolve runs there; elsewhere (a tool, a test) a store-only cache from the
settings resolves on a loop of its own. The version stays held (never evicted
from disk) until the process drops the model (``release``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from services.models.host_cache.cache import HeldModel, HostCache
from services.models.store.manifest import Manifest

_lock = threading.Lock()
_installed: tuple[HostCache, asyncio.AbstractEventLoop] | None = None
_holds: dict[str, HeldModel] = {}


def install(cache: HostCache, loop: asyncio.AbstractEventLoop) -> None:
    global _installed
    _installed = (cache, loop)


def _store_only_cache() -> HostCache:
    from services.config.sections import KernelSettings
    from services.models.host_cache.sources import store_only
    from services.models.store.objects import ObjectStore

    kernel = KernelSettings.from_env()
    store = ObjectStore.from_settings(kernel.model_store)
    capacity = int(kernel.model_store.model_cache_gb * 1e9)
    return HostCache(kernel.model_cache_dir, capacity_bytes=capacity, manifests=store, sources=store_only(store))


def model_dir(model: str, name: str, version: str | None) -> Path:
    """The directory of ``name:version``, held for the registry's ``model``. Blocks:
    call it from a worker thread, never from an event loop."""
    installed = _installed
    if installed is not None:
        cache, loop = installed
        held = asyncio.run_coroutine_threadsafe(cache.acquire(name, version), loop).result()
    else:
        held = asyncio.run(_store_only_cache().acquire(name, version))
    with _lock:
        previous = _holds.pop(model, None)
        _holds[model] = held
    if previous is not None:
        previous.release()
    return held.path


def held() -> dict[str, Manifest]:
    """The manifest of the version each registry model loaded from the store holds."""
    with _lock:
        return {model: h.manifest for model, h in _holds.items()}


def release(model: str) -> None:
    """The registry's ``model`` was dropped from memory: its version may be evicted from disk."""
    with _lock:
        held = _holds.pop(model, None)
    if held is not None:
        held.release()
