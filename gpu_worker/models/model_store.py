"""The sampler's side of the tiered model store (``services/models/host_cache``):
its host's cache, fetching from the peers that announce a blob before the object
store, under the fleet's origin leases; what its heartbeat says of that cache;
and the blobs it serves to other hosts. Nothing of it exists where no store is
configured."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats

from services.bus.presence_board import PresenceBoard
from services.config.sections import KernelSettings
from services.db.states import WorkerKind
from services.errors import BusError, ModelError
from services.mesh.rpc import MeshIdentity
from services.models.host_cache import HostCache, loading, peers
from services.models.host_cache.fleet import FleetSources
from services.models.host_cache.layout import Layout
from services.models.host_cache.origin import OriginLeases
from services.models.host_cache.sources import SourceChain, store_only
from services.models.host_cache.verification import verify_if_due
from services.models.store.errors import ModelNotInStore
from services.models.store.manifest import Manifest
from services.models.store.objects import ObjectStore
from services.presence_view import PresenceView, follow
from services.rpc.server import Channels

log = logging.getLogger(__name__)


# A directory's mtime moves in coarse ticks: a blob added in the tick of the last
# listing may leave it as it was. One changed this recently is listed at each beat.
SETTLED_NS = 2 * 10**9
# How often a sampler looks whether its host's cache is due a verification.
VERIFY_POLL_S = 600.0
# How often a sampler asks the store whether the versions it has loaded changed:
# a forced push or a removal reaches what it serves within this.
STALE_CHECK_S = 60.0


async def stale_models(cache: HostCache, held: Mapping[str, Manifest]) -> set[str]:
    """The registry models among ``held`` (each with the manifest it loaded) whose
    version the store no longer holds as it was: removed (the cache drops its copy),
    or pushed again with other content. A store that cannot be reached, or refuses,
    changes nothing."""
    stale = set()
    for model, loaded in held.items():
        try:
            now = await cache.manifest(loaded.name, loaded.version)
        except ModelNotInStore:
            stale.add(model)
            continue
        except (ModelError, OSError) as exc:
            log.warning("cannot check %s:%s in the model store: %s", loaded.name, loaded.version, exc)
            continue
        if now.digest != loaded.digest:
            stale.add(model)
    return stale


@dataclass
class CachedBlobs:
    """The host cache's complete blobs, for each heartbeat: listed again only when
    the blobs directory changed (a blob added or deleted changes its mtime), so a
    beat costs one stat, not a directory scan."""

    layout: Layout
    host_id: str
    _seen_mtime_ns: int | None = field(default=None, repr=False)
    _blobs: frozenset[str] = field(default=frozenset(), repr=False)

    def telemetry(self) -> dict[str, Any]:
        try:
            mtime_ns: int | None = os.stat(self.layout.root / "blobs" / "sha256").st_mtime_ns
        except FileNotFoundError:
            mtime_ns = None
        recent = mtime_ns is not None and time.time_ns() - mtime_ns < SETTLED_NS
        if mtime_ns != self._seen_mtime_ns or recent:
            self._seen_mtime_ns = mtime_ns
            self._blobs = frozenset(self.layout.complete_blobs())
        return peers.CacheAnnouncement(self.host_id, self._blobs).telemetry()


class SamplerModelStore:
    """The host cache of a sampler, with its peers (a presence view of the fleet's
    samplers, followed like the decoders' view) and, once NATS is up, its origin leases."""

    def __init__(self, kernel: KernelSettings, mesh: MeshIdentity | None) -> None:
        settings = kernel.model_store
        # Its own channels to the peers (over the sealed mesh where there is one).
        self.channels = Channels(mesh)
        self.store = ObjectStore.from_settings(settings)
        self.use_peers = settings.model_peers
        self.stale_after_s = kernel.worker_stale_after_s
        self.verify_every_s = settings.model_cache_verify_hours * 3600
        self.samplers = PresenceView((WorkerKind.SAMPLER,))
        # The host's identity first: the peers and the leases are asked on its behalf.
        layout = Layout(kernel.model_cache_dir)
        layout.make()
        host_id = layout.host_id()
        self.fleet: FleetSources | None = None
        if self.use_peers:
            self.fleet = FleetSources.for_channels(
                self.store,
                self.channels,
                peer_min_bytes_per_s=settings.model_peer_min_mbps * 1e6,
                peers_of=self.peers_of,
                leases=None,
                host=host_id,
            )
        capacity = int(settings.model_cache_gb * 1e9)
        sources = self.fleet or store_only(self.store)
        self.cache = HostCache(
            layout.root, capacity_bytes=capacity, manifests=self.store, sources=sources, scopes=self.scoped
        )
        self.announced = CachedBlobs(self.cache.layout, self.cache.host_id)

    @classmethod
    def of(cls, kernel: KernelSettings, mesh: MeshIdentity | None) -> SamplerModelStore | None:
        """None where no store is configured (the sampler is as it was)."""
        return cls(kernel, mesh) if kernel.model_store.model_store_url else None

    def scoped(self, prefix: str) -> tuple[ObjectStore, SourceChain]:
        """A store of its own under ``prefix`` (a tenant's adapters): its manifests,
        and its blobs from the peers (by digest, whoever's) then from there. Made at
        each load, once the origin leases are open."""
        store = self.store.scoped(prefix)
        return store, (self.fleet.reading(store) if self.fleet is not None else store_only(store))

    def peers_of(self, digest: str) -> list[str]:
        """The samplers of other hosts announcing ``digest``, best first."""
        fleet = self.samplers.all(WorkerKind.SAMPLER, stale_after_s=self.stale_after_s)
        return [w.address for w in peers.holders(fleet, digest, self.cache.host_id)]

    async def follow(
        self, nc: nats.NATS, open_board: Callable[[], Awaitable[PresenceBoard]], stop: asyncio.Event
    ) -> None:
        """Keeps the view of the fleet's samplers (who announces which blob) until ``stop``."""
        if self.use_peers:
            await follow(self.samplers, nc, open_board, stop)

    async def install(self, js: Any) -> None:
        """Once NATS is connected, before any model loads: the origin leases opened
        (where peers are asked; unreachable, the store is read directly), and the
        cache installed for the loads on this loop (``loading.model_dir``)."""
        if self.fleet is not None:
            try:
                self.fleet.leases = await OriginLeases.open(js, self.cache.host_id)
            except BusError as exc:
                log.warning("no origin leases (%s): this host reads the store without them", exc)
        loading.install(self.cache, asyncio.get_running_loop())
        log.info("host model cache %s (host %s) installed", self.cache.layout.root, self.cache.host_id)

    async def verify_periodically(self, stop: asyncio.Event) -> None:
        """Hashes the host cache again every ``verify_every_s`` (one sampler of the
        host at a time: the others find it done), until ``stop``."""
        if self.verify_every_s <= 0:
            return
        while not stop.is_set():
            try:
                found = await verify_if_due(self.cache.layout, self.verify_every_s, time.time())
            except (OSError, ModelError) as exc:
                log.warning("cannot verify the host model cache: %s", exc)
            else:
                if found is not None:
                    log.info(
                        "verified the host model cache: %d blobs (%.1f GB), corrupt %s, dropped %s",
                        found.checked,
                        found.checked_bytes / 1e9,
                        found.corrupt or "none",
                        found.dropped or "none",
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(self.verify_every_s, VERIFY_POLL_S))

    async def watch_loaded(self, stop: asyncio.Event, on_stale: Callable[[set[str]], None]) -> None:
        """Every ``STALE_CHECK_S`` until ``stop``: the loaded store models whose
        version was removed or pushed again with other content, to ``on_stale``."""
        while not stop.is_set():
            stale = await stale_models(self.cache, loading.held())
            if stale:
                log.warning("loaded models changed in the model store, to load afresh: %s", sorted(stale))
                on_stale(stale)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STALE_CHECK_S)

    async def close(self) -> None:
        await self.channels.close()
