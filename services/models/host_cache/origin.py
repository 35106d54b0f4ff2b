"""One origin fetch per blob across hosts: before a host reads a blob from the
object store it takes a lease on it in a NATS key-value bucket (``create`` is
atomic), refreshed while it fetches; the others wait for a peer to announce the
blob and fetch it from that peer, or take the lease over once it has expired (its
holder died). ``next_step`` is the decision, pure; ``OriginLeases`` the bucket."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from services.bus.connection import BUS_ERRORS
from services.errors import BusError
from services.models.host_cache.sources import Claim

log = logging.getLogger(__name__)

BUCKET = "DARKROOM_MODEL_ORIGIN"
STREAM = f"KV_{BUCKET}"
SUBJECT_PREFIX = f"$KV.{BUCKET}"
# A lease not refreshed for this long expires: its holder died mid-fetch.
LEASE_S = 30.0
DONE = "done:"


def lease_key(digest: str) -> str:
    return f"origin.{digest}"


@dataclass(frozen=True)
class Lease:
    holder: str  # the host id of the cache fetching it
    done: bool  # fetched: the holder's samplers will announce it


class Step(enum.Enum):
    PEERS = "peers"  # a peer announces it
    TAKE = "take"  # no one fetches it from the store: take the lease
    WAIT = "wait"  # another host fetches it from the store
    STORE = "store"  # waited long enough: the store, lease or not


def next_step(
    *,
    peers_have: bool,
    lease: Lease | None,
    own_host: str,
    waited_s: float,
    patience_s: float,
    peers_failed: bool = False,
) -> Step:
    """``peers_failed``: peers that announced the blob were tried and gave it not
    (cut off, too slow, wrong bytes): once the origin fetch is done, waiting for
    another announcement may take the whole patience, so the store is read."""
    if peers_have:
        return Step.PEERS
    if lease is None or (lease.holder == own_host and not lease.done):
        # Ours but not done: left by a sampler of this host that died (one fetches a blob per host).
        return Step.TAKE
    if waited_s >= patience_s or (peers_failed and lease.done):
        return Step.STORE
    return Step.WAIT


class OriginLeases:
    def __init__(self, kv: KeyValue, host: str) -> None:
        self.kv = kv
        self.host = host

    @classmethod
    async def open(cls, js: JetStreamContext, host: str, *, replicas: int = 1) -> OriginLeases:
        config = KeyValueConfig(
            bucket=BUCKET, history=1, ttl=LEASE_S, storage=StorageType.FILE, replicas=max(1, replicas)
        )
        try:
            try:
                return cls(await js.key_value(BUCKET), host)
            except (BucketNotFoundError, NotFoundError):
                return cls(await js.create_key_value(config), host)
        except BadRequestError:  # another host created it meanwhile
            return cls(await js.key_value(BUCKET), host)
        except BUS_ERRORS as exc:
            raise BusError(f"the origin lease bucket: {exc}") from exc

    async def read(self, digest: str) -> Lease | None:
        try:
            entry = await self.kv.get(lease_key(digest))
        except KeyNotFoundError:
            return None
        except BUS_ERRORS as exc:
            raise BusError(f"reading the origin lease of {digest}: {exc}") from exc
        value = (entry.value or b"").decode()
        return Lease(value.removeprefix(DONE), value.startswith(DONE))

    async def take(self, digest: str, *, over: bool = False) -> int | None:
        """The lease's revision if this host now holds it; None if another does."""
        key, value = lease_key(digest), self.host.encode()
        try:
            if over:
                entry = await self.kv.get(key)
                return await self.kv.update(key, value, last=entry.revision)
            return await self.kv.create(key, value)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            return None
        except BUS_ERRORS as exc:
            raise BusError(f"taking the origin lease of {digest}: {exc}") from exc

    @contextlib.asynccontextmanager
    async def holding(self, digest: str, revision: int) -> AsyncIterator[Claim]:
        """Refreshed while the body fetches and checks the blob; marked done if the
        body set ``verified`` (the others wait for the announcement, not take it),
        deleted if not (one takes it now)."""
        refresh = asyncio.create_task(self._refresh(digest, revision))
        claim = Claim()
        try:
            yield claim
        finally:
            refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresh
            with contextlib.suppress(*BUS_ERRORS, KeyWrongLastSequenceError):
                if claim.verified:
                    await self.kv.put(lease_key(digest), f"{DONE}{self.host}".encode())
                else:
                    await self.kv.delete(lease_key(digest))

    async def _refresh(self, digest: str, revision: int) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            try:
                revision = await self.kv.update(lease_key(digest), self.host.encode(), last=revision)
            except (KeyWrongLastSequenceError, KeyNotFoundError):
                log.warning("lost the origin lease of %s (expired); fetching on regardless", digest)
                return
            except BUS_ERRORS as exc:
                log.warning("cannot refresh the origin lease of %s: %s", digest, exc)
