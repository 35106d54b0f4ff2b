"""The sources a sampler's host cache tries for a blob: the peers that announce it
(presence), then the object store, once per fleet where the origin leases are
reachable (``origin``), else directly."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from services.errors import BusError
from services.models.host_cache.origin import OriginLeases, Step, next_step
from services.models.host_cache.peers import PEER_MIN_BYTES_PER_S, PeerSource
from services.models.host_cache.sources import BlobSource, Claim, StoreSource
from services.rpc.server import Channels

log = logging.getLogger(__name__)

# How long a host waits for the host holding a blob's origin lease to announce it.
PATIENCE_S = 600.0
POLL_S = 0.5
STORE_TRIES = 2


class LeasedStoreSource(BlobSource):
    """The store, read under this host's origin lease: held while the cache fetches
    and checks the bytes, marked done only if they passed (the other hosts then
    wait for this one to announce the blob), let go if not (one takes it at once)."""

    kind = "store"

    def __init__(self, store: StoreSource, leases: OriginLeases, revision: int) -> None:
        self.store, self.leases, self.revision = store, leases, revision

    async def fetch(self, digest: str, size: int, dest_fd: int, offset: int) -> None:
        await self.store.fetch(digest, size, dest_fd, offset)

    def claim(self, digest: str) -> AbstractAsyncContextManager[Claim]:
        return self.leases.holding(digest, self.revision)


class FleetSources:
    """A ``SourceChain``: ``peers_of(digest)`` gives the addresses of other hosts'
    samplers announcing it (``peers.holders``), best first."""

    def __init__(
        self,
        store: Any,
        *,
        peer_source: Callable[[str], BlobSource],
        peers_of: Callable[[str], list[str]],
        leases: OriginLeases | None,
        host: str,
        patience_s: float = PATIENCE_S,
        poll_s: float = POLL_S,
    ) -> None:
        self.store = StoreSource(store)
        self.peer_source = peer_source
        self.peers_of = peers_of
        self.leases = leases
        self.host = host
        self.patience_s = patience_s
        self.poll_s = poll_s

    @classmethod
    def for_channels(
        cls, store: Any, channels: Channels, *, peer_min_bytes_per_s: float = PEER_MIN_BYTES_PER_S, **kwargs: Any
    ) -> FleetSources:
        # Peers are read as the store is: as many ranges at once, of the same size.
        def peer_source(address: str) -> PeerSource:
            return PeerSource(
                address,
                channels,
                min_bytes_per_s=peer_min_bytes_per_s,
                streams=store.fetch_streams,
                range_bytes=store.fetch_range_bytes,
            )

        return cls(store, peer_source=peer_source, **kwargs)

    def reading(self, store: Any) -> FleetSources:
        """The same peers and leases, and ``store`` (a scoped one) last."""
        other = copy.copy(self)
        other.store = StoreSource(store)
        return other

    async def __call__(self, digest: str, size: int) -> AsyncIterator[BlobSource]:
        tried: set[str] = set()
        store_tries = 0
        started = time.monotonic()
        while store_tries < STORE_TRIES:
            fresh = [a for a in self.peers_of(digest) if a not in tried]
            for address in fresh:
                tried.add(address)
                yield self.peer_source(address)
            if self.leases is None:
                store_tries += 1
                yield self.store
                continue
            try:
                lease = await self.leases.read(digest)
                step = next_step(
                    peers_have=any(a not in tried for a in self.peers_of(digest)),
                    lease=lease,
                    own_host=self.host,
                    waited_s=time.monotonic() - started,
                    patience_s=self.patience_s,
                    peers_failed=bool(tried),
                )
                if step is Step.TAKE:
                    revision = await self.leases.take(digest, over=lease is not None)
                    if revision is not None:
                        store_tries += 1
                        yield LeasedStoreSource(self.store, self.leases, revision)
                    continue
            except BusError as exc:
                log.warning("origin leases unreachable (%s); blob %s from the store directly", exc, digest)
                step = Step.STORE
            if step is Step.STORE:
                store_tries += 1
                yield self.store
            elif step is Step.WAIT:
                await asyncio.sleep(self.poll_s)
