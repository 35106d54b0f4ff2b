"""Which models stay in a sampler's memory: pure choice of what to evict.

Models are evicted by eviction priority (lower first), then least recent use;
the ones pinned to the worker go last. Sizes are real bytes, measured when a
model loaded, or the registry's figure for one never loaded here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    name: str
    bytes: int
    eviction_priority: int
    last_used: float
    pinned: bool = False


class DoesNotFit(Exception):
    pass


def victims(need: int, free: int, residents: Sequence[Resident]) -> list[str]:
    """The models to evict, in order, so that ``need`` bytes fit in ``free`` plus
    what they free. DoesNotFit if evicting everything would not make room."""
    order = sorted(residents, key=lambda r: (r.pinned, r.eviction_priority, r.last_used, r.name))
    chosen: list[str] = []
    for resident in order:
        if need <= free:
            break
        chosen.append(resident.name)
        free += resident.bytes
    if need > free:
        raise DoesNotFit(f"needs {need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB can be freed")
    return chosen
