"""Which model versions to evict when the cache is over its bytes: a pure function
over a snapshot of the cache, least recently used first, never a held one. A
blob shared by versions is freed only once no remaining version names it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CachedVersion:
    name: str
    version: str
    last_used: float  # seconds since the epoch
    held: bool  # a sampler has it loaded
    blobs: frozenset[str]


@dataclass(frozen=True)
class Snapshot:
    versions: Sequence[CachedVersion]
    blob_sizes: Mapping[str, int]  # every complete blob, referenced or not

    @property
    def total_bytes(self) -> int:
        return sum(self.blob_sizes.values())


def unreferenced(snapshot: Snapshot) -> set[str]:
    """Blobs no cached version names (left by an eviction, or by a resolve that failed)."""
    named = set().union(*(v.blobs for v in snapshot.versions))
    return set(snapshot.blob_sizes) - named


def to_evict(snapshot: Snapshot, capacity_bytes: int, need_bytes: int = 0) -> list[CachedVersion]:
    """The versions to evict, least recently used first, so that the cache holds at
    most ``capacity_bytes`` with ``need_bytes`` more to come; held ones are skipped
    (the cache may then stay over its bound: what is loaded cannot go)."""
    free = sum(snapshot.blob_sizes[d] for d in unreferenced(snapshot))
    over = snapshot.total_bytes - free + need_bytes - capacity_bytes
    if over <= 0:
        return []
    remaining = list(snapshot.versions)
    chosen: list[CachedVersion] = []
    for victim in sorted(snapshot.versions, key=lambda v: (v.last_used, v.name, v.version)):
        if over <= 0:
            break
        if victim.held:
            continue
        remaining.remove(victim)
        still_named = set().union(*(v.blobs for v in remaining))
        freed = sum(snapshot.blob_sizes.get(d, 0) for d in victim.blobs - still_named)
        chosen.append(victim)
        over -= freed
    return chosen
