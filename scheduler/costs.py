"""What a model costs the policy: the registry's first figures, corrected by what
the samplers measured as they loaded it."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from scheduler.policy import ModelCost
from scheduler.snapshot import Worker
from services.models.registry import ModelRegistry


def costs_from(registry: ModelRegistry) -> dict[str, ModelCost]:
    return {
        name: ModelCost(
            capability=spec.capability,
            step_s_512=spec.step_s_512,
            load_s=spec.load_seconds,
            vram_bytes=spec.vram_bytes,
            eviction_priority=spec.eviction_priority,
            max_batch=spec.max_batch,
            parallel_size=spec.parallel.size,
        )
        for name, spec in registry.models.items()
    }


def measured_costs(costs: Mapping[str, ModelCost], workers: Sequence[Worker]) -> dict[str, ModelCost]:
    """The registry's costs, corrected by what workers measured: the median load
    time, and the largest footprint when it is bigger than the registry says."""
    loads: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    for w in workers:
        for name, size, load_s in w.measured:
            if name in costs:
                loads.setdefault(name, []).append(load_s)
                sizes[name] = max(sizes.get(name, 0), size)
    corrected = dict(costs)
    for name, seen in loads.items():
        cost = costs[name]
        corrected[name] = replace(
            cost, load_s=statistics.median(seen), vram_bytes=max(cost.vram_bytes, sizes.get(name, 0))
        )
    return corrected
