"""Checking a host cache's blobs against their digests again: a file that rotted on
disk, or that someone edited, keeps its size, so only a hash finds it. What fails
is deleted with the model directories that link it, and fetched again (verified) at
the next load. Hashing holds no lock (a blob under ``blobs/`` is never written
again, only deleted or replaced whole), so loads go on meanwhile; only dropping what
failed takes the cache's lock. ``darkroom models verify`` checks at once; each
sampler checks its host's cache every DARKROOM_MODEL_CACHE_VERIFY_HOURS, one sampler
of a host at a time, the last check's time kept in the cache (``verified``)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from services.models.host_cache.blobs import sha256_of
from services.models.host_cache.layout import Layout
from services.models.host_cache.locks import lock_now, locked
from services.models.host_cache.metrics import CORRUPT_BLOBS

log = logging.getLogger(__name__)


@dataclass
class Verification:
    checked: int = 0
    checked_bytes: int = 0
    corrupt: list[str] = field(default_factory=list)  # the digests deleted
    dropped: list[str] = field(default_factory=list)  # the "name:version" directories that linked them


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


async def verify(layout: Layout) -> Verification:
    """Every complete blob hashed again; a corrupt one deleted with the directories
    that link it."""
    done = Verification()
    failed: dict[str, tuple[int, int, int]] = {}
    for digest in layout.complete_blobs():
        try:
            fd = os.open(layout.blob(digest), os.O_RDONLY)
        except FileNotFoundError:
            continue  # evicted meanwhile
        try:
            seen = os.fstat(fd)
            actual = await asyncio.to_thread(sha256_of, fd)
        finally:
            os.close(fd)
        done.checked += 1
        done.checked_bytes += seen.st_size
        if actual != digest:
            failed[digest] = _identity(seen)
    if failed:
        async with locked(layout.cache_lock):
            _drop(layout, failed, done)
    return done


def _drop(layout: Layout, failed: dict[str, tuple[int, int, int]], done: Verification) -> None:
    rotten: set[tuple[int, int]] = set()
    for digest, seen in failed.items():
        try:
            now = os.stat(layout.blob(digest))
        except FileNotFoundError:
            continue
        if _identity(now) == seen:  # not fetched again (and verified) since it was hashed
            rotten.add((now.st_dev, now.st_ino))
            done.corrupt.append(digest)
    for model_dir in sorted(layout.root.glob("models/*/*")):
        if model_dir.name.startswith("."):
            continue
        files = (f.stat() for f in model_dir.rglob("*") if f.is_file() and not f.name.startswith("."))
        if any((st.st_dev, st.st_ino) in rotten for st in files):
            layout.discard(model_dir)  # never loaded again; a sampler holding it keeps what it has open
            done.dropped.append(f"{model_dir.parent.name}:{model_dir.name}")
    for digest in done.corrupt:
        CORRUPT_BLOBS.labels(source="cache").inc()
        log.warning("blob %s in the host's model cache is corrupt; deleted", digest)
        layout.blob(digest).unlink(missing_ok=True)


def stamp(layout: Layout) -> Path:
    """Its mtime: when the cache was last verified whole."""
    return layout.root / "verified"


async def verify_if_due(layout: Layout, every_s: float, now: float) -> Verification | None:
    """A verification if the last was ``every_s`` or more before ``now`` and no other
    sampler of the host is verifying; None if not. A cache never verified is
    stamped now: its blobs were checked as they came."""
    lock = lock_now(layout.root / "locks" / "verify")
    if lock is None:
        return None
    try:
        try:
            last = stamp(layout).stat().st_mtime
        except FileNotFoundError:
            stamp(layout).touch()
            os.utime(stamp(layout), (now, now))
            return None
        if now - last < every_s:
            return None
        done = await verify(layout)
        os.utime(stamp(layout), (now, now))
        return done
    finally:
        os.close(lock)
