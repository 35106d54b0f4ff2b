"""A host's model cache (``layout``): resolving a model version into a directory
``from_pretrained`` loads from (safetensors memory-mapped straight from the
blobs: the directory's files are hard links to them), holding it while it is
loaded, and evicting the least recently used versions no sampler holds
(``verification`` checks every blob's digest again)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.errors import ModelError
from services.models.host_cache import blobs as blob_fetch
from services.models.host_cache.eviction import CachedVersion, Snapshot, to_evict
from services.models.host_cache.layout import BUILT_FROM, HELD, USED, Layout
from services.models.host_cache.locks import acquire, lock_now, locked
from services.models.host_cache.metrics import EVICTIONS, LOOKUPS
from services.models.host_cache.sources import SourceChain
from services.models.store.errors import ModelNotInStore, ModelStoreUnavailable
from services.models.store.manifest import Manifest

log = logging.getLogger(__name__)

# Blobs of one version fetched at once (each from one source, the store's own reads concurrent).
BLOBS_AT_ONCE = 4


class ManifestReader(Protocol):
    """The object store, as far as manifests go (``ObjectStore.read_manifest``)."""

    def read_manifest(self, name: str, version: str | None) -> Manifest: ...  # or async


@dataclass(eq=False)
class HeldModel:
    """A model version's directory, kept from eviction until ``release`` (a shared
    lock on its ``.held``, which dies with the process)."""

    path: Path
    manifest: Manifest
    _fd: int | None = field(repr=False)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HeldModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# The manifests and blob sources of a store of its own under a prefix of the bucket
# (a tenant's adapters: ``ObjectStore.scoped``).
Scopes = Callable[[str], tuple[ManifestReader, SourceChain]]


class HostCache:
    """``scopes``: where a version under a prefix of the store is read from (None:
    nothing but the store's own). Every version shares the one directory: its
    names are the manifests' (a scoped store's are its own: ``tenant_store_name``),
    its blobs are by digest, whoever's."""

    def __init__(
        self,
        root: Path,
        *,
        capacity_bytes: int,
        manifests: ManifestReader,
        sources: SourceChain,
        scopes: Scopes | None = None,
    ) -> None:
        self.layout = Layout(Path(root))
        self.layout.make()
        self.capacity_bytes = capacity_bytes
        self.manifests = manifests
        self.sources = sources
        self.scopes = scopes
        self.host_id = self.layout.host_id()
        # Bytes this cache object fetched, by source kind (the metrics count every cache of the process).
        self.fetched: collections.Counter[str] = collections.Counter()

    async def resolve(self, name: str, version: str | None = None) -> Path:
        """The version's directory, fetched first where it is not complete (not held after)."""
        with await self.acquire(name, version) as held:
            return held.path

    async def acquire(self, name: str, version: str | None = None, *, prefix: str = "") -> HeldModel:
        """The version's directory, complete, held until released; ``prefix``: of the
        store of its own there (``scopes``)."""
        reader, sources = self.manifests, self.sources
        if prefix:
            if self.scopes is None:
                raise ModelError(f"{name}: this host's cache reads nothing under {prefix!r} of the store")
            reader, sources = self.scopes(prefix)
        manifest = await self.manifest(name, version, reader=reader)
        model_dir = self.layout.model(manifest.name, manifest.version)
        missing = {d: s for d, s in manifest.blobs().items() if not blob_fetch.is_complete(self.layout.blob(d), s)}
        if missing:
            await self.evict(need_bytes=sum(missing.values()))
        async with locked(self.layout.cache_lock, shared=True):
            if _built(self.layout, model_dir, manifest) and not missing:
                LOOKUPS.labels(result="hit").inc()
            else:
                LOOKUPS.labels(result="miss").inc()
                await self._fetch_all(manifest, sources)
                async with locked(self.layout.model_lock(manifest.name, manifest.version)):
                    if not _built(self.layout, model_dir, manifest):
                        self._build(model_dir, manifest)
            hold = await acquire(model_dir / HELD, shared=True)
            os.utime(model_dir / USED)
        await self.evict()
        return HeldModel(model_dir, manifest, hold)

    async def manifest(self, name: str, version: str | None, *, reader: ManifestReader | None = None) -> Manifest:
        """From the store (``reader``: a scoped one; a copy kept); the copy only when
        the store cannot be reached. A version the store says it does not hold was
        removed: the copy and its directory go too (its blobs with the next
        eviction), so a model withdrawn from the store stops loading, and being
        offered to peers, here."""
        try:
            read = (reader or self.manifests).read_manifest
            if inspect.iscoroutinefunction(read):
                manifest = await read(name, version)
            else:  # a blocking client's call, off the event loop
                manifest = await asyncio.to_thread(read, name, version)
        except ModelNotInStore:
            await self._forget(name, version)
            raise
        except (ModelStoreUnavailable, OSError) as exc:
            kept = self._kept_manifest(name, version)
            if kept is None:
                raise
            log.warning("cannot read %s:%s from the store (%s); using the cache's copy", name, version, exc)
            return kept
        if manifest.name != name or (version is not None and manifest.version != version):
            raise ModelError(f"the store answered {name}:{version} with {manifest.name}:{manifest.version}")
        _write_atomically(self.layout.manifest(name, manifest.version), manifest.to_json())
        if version is None:
            _write_atomically(self.layout.latest(name), manifest.version.encode())
        return manifest

    def _kept_manifest(self, name: str, version: str | None) -> Manifest | None:
        try:
            if version is None:
                version = self.layout.latest(name).read_text().strip()
            return Manifest.from_json(self.layout.manifest(name, version).read_bytes())
        except (FileNotFoundError, ModelError):
            return None

    async def _forget(self, name: str, version: str | None) -> None:
        """Drops the kept copy of ``name:version`` (of what latest pointed at, for
        None) and its directory, even if a sampler holds it: what it has loaded
        stays in its memory, nothing loads it again."""
        async with locked(self.layout.cache_lock, shared=True):
            if version is None:
                latest = self.layout.latest(name)
                try:
                    version = latest.read_text().strip()
                except FileNotFoundError:
                    return
                latest.unlink(missing_ok=True)
            self.layout.manifest(name, version).unlink(missing_ok=True)
            model_dir = self.layout.model(name, version)
            async with locked(self.layout.model_lock(name, version)):
                if model_dir.exists():
                    self.layout.discard(model_dir)
                    log.warning("%s:%s was removed from the model store; dropped from the host's cache", name, version)

    async def _fetch_all(self, manifest: Manifest, sources: SourceChain) -> None:
        gate = asyncio.Semaphore(BLOBS_AT_ONCE)

        async def one(digest: str, size: int) -> None:
            async with gate:
                await blob_fetch.ensure_blob(self.layout, digest, size, sources, self.fetched)

        async with asyncio.TaskGroup() as tg:
            for digest, size in manifest.blobs().items():
                tg.create_task(one(digest, size))

    def _build(self, model_dir: Path, manifest: Manifest) -> None:
        """The directory built aside, then renamed into place: a sampler sees it whole or not at all."""
        if model_dir.exists():
            log.warning("%s is incomplete or damaged; rebuilding it", model_dir)
            self.layout.discard(model_dir)
        building = model_dir.parent / f".build-{manifest.version}-{uuid.uuid4().hex}"
        building.mkdir(parents=True)
        try:
            for ref in manifest.files:
                target = building / ref.path
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(self.layout.blob(ref.digest), target)
            (building / BUILT_FROM).write_text(manifest.digest)
            (building / HELD).touch()
            (building / USED).touch()
            os.rename(building, model_dir)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise

    # -- eviction -------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        versions = []
        for model_dir in sorted(self.layout.root.glob("models/*/*")):
            if model_dir.name.startswith("."):
                continue
            manifest = self._kept_manifest(model_dir.parent.name, model_dir.name)
            if manifest is None:
                continue
            free = lock_now(model_dir / HELD)
            if free is not None:
                os.close(free)
            try:
                used = (model_dir / USED).stat().st_mtime
            except FileNotFoundError:
                used = 0.0
            versions.append(
                CachedVersion(manifest.name, manifest.version, used, free is None, frozenset(manifest.blobs()))
            )
        sizes = {p.name: p.stat().st_size for p in (self.layout.root / "blobs" / "sha256").iterdir()}
        return Snapshot(versions, sizes)

    async def evict(self, need_bytes: int = 0) -> list[str]:
        """Makes room (``need_bytes`` more within the capacity) if no resolve is under
        way on the host (else the next resolve does); the versions evicted."""
        cache = lock_now(self.layout.cache_lock)
        if cache is None:
            return []
        try:
            evicted = []
            for victim in to_evict(self.snapshot(), self.capacity_bytes, need_bytes):
                model_dir = self.layout.model(victim.name, victim.version)
                hold = lock_now(model_dir / HELD)
                if hold is None:
                    continue  # held since the snapshot
                try:
                    self.layout.discard(model_dir)
                finally:
                    os.close(hold)
                EVICTIONS.inc()
                evicted.append(f"{victim.name}:{victim.version}")
                log.info("evicted %s:%s from the host's model cache", victim.name, victim.version)
            self._drop_unlinked_blobs()
            return evicted
        finally:
            os.close(cache)

    def _drop_unlinked_blobs(self) -> None:
        """Blobs no model directory links (a link count of one) are deleted."""
        for blob in (self.layout.root / "blobs" / "sha256").iterdir():
            if blob.stat().st_nlink == 1:
                blob.unlink()


def _built(layout: Layout, model_dir: Path, manifest: Manifest) -> bool:
    """Built from this very manifest, every file its blob itself: sizes alone would
    take a version pushed again with other bytes of the same sizes (a fine-tune)
    for the one already built."""
    try:
        if (model_dir / BUILT_FROM).read_text() != manifest.digest or not (model_dir / HELD).exists():
            return False
        linked = (os.path.samestat(os.stat(model_dir / f.path), os.stat(layout.blob(f.digest))) for f in manifest.files)
        return all(linked)
    except FileNotFoundError:
        return False


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fresh.write_bytes(data)
    os.replace(fresh, path)
