"""Fetching one blob into a host's cache, once per host: under the blob's lock,
from each source in turn, resumed from the partial file's bytes, kept only once
its SHA-256 matches (``partial/<hex>`` is renamed into ``blobs/``, so nothing
unverified is ever under ``blobs/``)."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os

from services.errors import ModelError
from services.models.host_cache.layout import Layout
from services.models.host_cache.locks import locked
from services.models.host_cache.metrics import CORRUPT_BLOBS, FETCHED_BYTES
from services.models.host_cache.sources import BlobSource, BlobSourceFailed, SourceChain

log = logging.getLogger(__name__)

HASH_CHUNK = 8 * 2**20


def sha256_of(fd: int) -> str:
    digest = hashlib.sha256()
    position = 0
    while chunk := os.pread(fd, HASH_CHUNK, position):
        digest.update(chunk)
        position += len(chunk)
    return digest.hexdigest()


def is_complete(path: os.PathLike[str] | str, size: int) -> bool:
    """Present with the manifest's size (a cheap check; ``HostCache.verify`` rehashes)."""
    try:
        return os.stat(path).st_size == size
    except FileNotFoundError:
        return False


async def ensure_blob(
    layout: Layout, digest: str, size: int, chain: SourceChain, fetched: collections.Counter[str]
) -> bool:
    """The blob complete under ``blobs/``; True if it was fetched here now."""

    path = layout.blob(digest)
    if is_complete(path, size):
        return False
    async with locked(layout.blob_lock(digest)):
        if is_complete(path, size):
            return False  # another sampler of this host fetched it while this one waited
        if path.exists():
            log.warning("blob %s in the cache has the wrong size; fetching it again", digest)
            CORRUPT_BLOBS.labels(source="cache").inc()
            path.unlink()
        fd = os.open(layout.partial(digest), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            async for source in chain(digest, size):
                if await _fetch_from(source, digest, size, fd, fetched):
                    await asyncio.to_thread(os.fsync, fd)
                    os.rename(layout.partial(digest), path)
                    return True
        finally:
            os.close(fd)
    raise ModelError(f"blob {digest} ({size} bytes): no source could give it")


def _bytes_kept(fd: int, size: int) -> int:
    have = os.fstat(fd).st_size
    if have > size:  # not this blob's bytes
        os.ftruncate(fd, 0)
        return 0
    return have


async def _fetch_from(source: BlobSource, digest: str, size: int, fd: int, fetched: collections.Counter[str]) -> bool:
    """Whether ``source`` completed the blob with the right bytes, checked inside the
    source's claim (an origin lease is done only once the bytes passed)."""
    async with source.claim(digest) as claim:
        claim.verified = await _fetch_checked(source, digest, size, fd, fetched)
    return claim.verified


async def _fetch_checked(
    source: BlobSource, digest: str, size: int, fd: int, fetched: collections.Counter[str]
) -> bool:
    """A resumed fetch that fails its check is tried once more from the start,
    since the bytes kept may be the ones at fault (another source's, or a crash's)."""

    for _ in range(2):
        offset = _bytes_kept(fd, size)
        try:
            if offset < size:
                await source.fetch(digest, size, fd, offset)
        except BlobSourceFailed as exc:
            log.warning("blob %s: %s; %d of %d bytes kept", digest, exc, os.fstat(fd).st_size, size)
            return False
        finally:
            gained = max(0, os.fstat(fd).st_size - offset)
            fetched[source.kind] += gained
            FETCHED_BYTES.labels(source=source.kind).inc(gained)
        if os.fstat(fd).st_size == size and await asyncio.to_thread(sha256_of, fd) == digest:
            return True
        log.warning("blob %s from %s failed its SHA-256 check; discarded", digest, source.kind)
        CORRUPT_BLOBS.labels(source=source.kind).inc()
        os.ftruncate(fd, 0)
        if offset == 0:
            return False
    return False
