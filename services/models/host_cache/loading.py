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
from services.models.host_cache.sources import SourceChain
from services.models.store.manifest import Manifest

_lock = threading.Lock()
_installed: tuple[HostCache, asyncio.AbstractEventLoop] | None = None
# Each held version, with the prefix of the store it came from ("": the store's own).
_holds: dict[str, tuple[HeldModel, str]] = {}


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

    def scopes(prefix: str) -> tuple[ObjectStore, SourceChain]:
        scoped = store.scoped(prefix)
        return scoped, store_only(scoped)

    return HostCache(
        kernel.model_cache_dir, capacity_bytes=capacity, manifests=store, sources=store_only(store), scopes=scopes
    )


def model_dir(model: str, name: str, version: str | None, *, prefix: str = "") -> Path:
    """The directory of ``name:version`` (of the store of its own under ``prefix``),
    held for ``model``. Blocks: call it from a worker thread, never from an event loop."""
    installed = _installed
    if installed is not None:
        cache, loop = installed
        held = asyncio.run_coroutine_threadsafe(cache.acquire(name, version, prefix=prefix), loop).result()
    else:
        held = asyncio.run(_store_only_cache().acquire(name, version, prefix=prefix))
    with _lock:
        previous = _holds.pop(model, None)
        _holds[model] = (held, prefix)
    if previous is not None:
        previous[0].release()
    return held.path


def held() -> dict[str, Manifest]:
    """The manifest of the version each registry model (or adapter) loaded from the
    store's own holds; what came from under a prefix (a tenant's adapter) is not
    listed: its owner removes it through the gateway, which stops its jobs."""
    with _lock:
        return {model: h.manifest for model, (h, prefix) in _holds.items() if not prefix}


def release(model: str) -> None:
    """The registry's ``model`` was dropped from memory: its version may be evicted from disk."""
    with _lock:
        held = _holds.pop(model, None)
    if held is not None:
        held[0].release()
