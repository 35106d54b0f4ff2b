"""Which of a host's devices form groups, each serving parallel models as one
sampler (docs/parallel.md), from ``DARKROOM_GPU_GROUPS``:

- ``auto`` (the default): one group of the largest size the registry's parallel
  models name, when the host has that many devices; the rest stay single samplers.
  Its devices are the best connected (``distance``: NVLink nearest, then the PCIe
  hierarchy, as NVML's topology says), the highest-numbered among equals: a host of
  8 with 4-way models whose cards are alike keeps GPUs 0-3 single.
- ``off``: none.
- explicit ranges, ``4-7`` or ``0-1,2-3``: those devices, each range one group, in
  rank order (the first leads).

Pure: the host's device count and the registry's sizes in, groups of indices out."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection

from services.models.parallel import MAX_DEGREE


class GroupPlanError(ValueError):
    """A ``DARKROOM_GPU_GROUPS`` that cannot be formed on this host."""


# Two devices' distance (lower is nearer): 0 over NVLink, else NVML's topology level.
Distance = Callable[[int, int], int]


def plan_groups(
    spec: str, devices: int, sizes: Collection[int], distance: Distance | None = None
) -> list[tuple[int, ...]]:
    """The groups ``spec`` forms of ``devices`` devices; ``sizes``: the replica sizes
    of the registry's parallel models; ``distance``: the devices' topology, where known."""
    spec = spec.strip().lower()
    if spec == "off":
        return []
    if spec == "auto":
        fitting = [s for s in sizes if 1 < s <= devices]
        if not fitting:
            return []
        size = max(fitting)
        if distance is None:
            return [tuple(range(devices - size, devices))]
        return [nearest(size, devices, distance)]
    groups: list[tuple[int, ...]] = []
    taken: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        first, sep, last = part.partition("-")
        if not sep or not first.isdigit() or not last.isdigit() or int(first) >= int(last):
            raise GroupPlanError(f"DARKROOM_GPU_GROUPS: {part!r} is not a range such as 0-1 (auto, off, or ranges)")
        group = tuple(range(int(first), int(last) + 1))
        if group[-1] >= devices:
            raise GroupPlanError(f"DARKROOM_GPU_GROUPS: {part!r} names device {group[-1]}; this host has {devices}")
        if len(group) > MAX_DEGREE:
            raise GroupPlanError(f"DARKROOM_GPU_GROUPS: {part!r} is more than {MAX_DEGREE} devices")
        if taken & set(group):
            raise GroupPlanError(f"DARKROOM_GPU_GROUPS: {part!r} overlaps another group")
        taken |= set(group)
        groups.append(group)
    return groups


def group_name(kind: str, group: tuple[int, ...]) -> str:
    """``gpus4-7``: the group's devices, in its worker id (no ``+``, which ids refuse)."""
    return f"{kind}s{group[0]}-{group[-1]}"


def nearest(size: int, devices: int, distance: Distance) -> tuple[int, ...]:
    """The ``size`` devices of ``devices`` whose farthest pair is nearest, then whose
    pairs are nearest in all; among equals, the highest-numbered."""

    def cost(group: tuple[int, ...]) -> tuple[int, int, int]:
        pairs = [distance(a, b) for a, b in itertools.combinations(group, 2)]
        return max(pairs), sum(pairs), -sum(group)

    return min(itertools.combinations(range(devices), size), key=cost)


def nvml_distance(physical: list[int]) -> Distance | None:
    """The topology of the GPUs whose NVML indices are ``physical`` (the visible ones,
    in order), or None where NVML cannot say (no driver, a CPU host)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in physical]
    except Exception:
        return None

    def distance(a: int, b: int) -> int:
        try:
            nvlink = pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if nvlink == pynvml.NVML_P2P_STATUS_OK:
                return 0
            return int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
        except Exception:  # not supported on this pair: as far as a system apart
            return int(getattr(pynvml, "NVML_TOPOLOGY_SYSTEM", 50))

    return distance
