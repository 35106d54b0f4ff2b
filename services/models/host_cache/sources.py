"""Where a host's cache fetches a blob from: a ``BlobSource`` writes the blob's
bytes from ``offset`` into an open file. Whatever it does, when it returns or
raises, the file's size is how many bytes from the start are its own (written in
order, or cut back): a resumed fetch goes on from there. No source is trusted:
the cache checks the digest of what it wrote."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from services.errors import ModelError


class BlobSourceFailed(ModelError):
    """A source could not give the blob (away, cut off mid-transfer, does not hold it)."""


@dataclass
class Claim:
    """What a fetch holds of a blob for the fleet while the cache fetches and checks
    it (an origin lease), told at the end whether the bytes passed their digest."""

    verified: bool = False


class BlobSource(Protocol):
    # What the metrics count its bytes as: "peer" or "store".
    kind: str

    async def fetch(self, digest: str, size: int, dest_fd: int, offset: int) -> None: ...

    def claim(self, digest: str) -> AbstractAsyncContextManager[Claim]:
        """Held around a fetch and the check of its bytes; most sources claim nothing."""
        return contextlib.nullcontext(Claim())


# The sources to try for one blob (digest, size), in order; asked lazily, so that
# one may wait (for a peer to finish what another host fetches from the store).
SourceChain = Callable[[str, int], AsyncIterator[BlobSource]]


class StoreSource(BlobSource):
    """The object store (``ObjectStore.read_blob``: concurrent ranged reads, written
    where they belong, so a failure may leave holes: the file is cut back to where
    this fetch started)."""

    kind = "store"

    def __init__(self, store: Any) -> None:
        self.store = store

    async def fetch(self, digest: str, size: int, dest_fd: int, offset: int) -> None:
        try:
            await self.store.read_blob(digest, size, dest_fd, offset=offset)
        except BaseException as exc:
            os.ftruncate(dest_fd, offset)
            if isinstance(exc, ModelError | OSError):
                raise BlobSourceFailed(f"the store: {exc}") from exc
            raise


def store_only(store: Any) -> SourceChain:
    source = StoreSource(store)

    async def chain(digest: str, size: int) -> AsyncIterator[BlobSource]:
        yield source

    return chain
