"""Warm-set planning: which models each GPU keeps loaded, following demand.

The slow loop beside placement. Demand per model is measured in speed-1.0 seconds
of work per second and forecast per latency class (``forecast``); each GPU gives
its measured speed to one primary model, and the plan moves GPUs between models
only when that lowers the busiest model's load by a clear margin, so noise in the
demand does not make the fleet thrash. Room left on a GPU is filled with other
wanted models that fit beside the primary (never best-effort ones).

Pure: demand, workers and costs in; the planned warm set per worker out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.policy import ModelCost
from services.db.states import WorkerStatus

# A move must lower the busiest model's load by this fraction to be worth a load.
HYSTERESIS = 0.15


@dataclass(frozen=True)
class GpuView:
    id: str
    models: frozenset[str]  # models it can serve
    warm_models: frozenset[str]
    vram_total_bytes: int  # 0: unlimited (a CPU worker)
    speed: float
    state: WorkerStatus = WorkerStatus.READY
    primary: str | None = None  # the primary model of the last plan, if any


@dataclass(frozen=True)
class WarmSet:
    primary: str | None  # the model this GPU's speed is counted for
    models: frozenset[str]  # everything it should keep loaded, the primary included


def _fits(gpu: GpuView, model: str, costs: Mapping[str, ModelCost]) -> bool:
    return model in gpu.models and (not gpu.vram_total_bytes or costs[model].vram_bytes <= gpu.vram_total_bytes)


def _capability(model: str | None, costs: Mapping[str, ModelCost]) -> str | None:
    return costs[model].capability if model is not None else None


def _load(model: str, demand: Mapping[str, float], capacity: Mapping[str, float]) -> float:
    need = demand.get(model, 0.0)
    if need <= 0:
        return 0.0
    have = capacity.get(model, 0.0)
    return need / have if have > 0 else float("inf")


def _best_move(
    model: str,
    gpus: Sequence[GpuView],
    primary: Mapping[str, str | None],
    speed: Mapping[str, float],
    cap: Mapping[str, float],
    demand: Mapping[str, float],
    costs: Mapping[str, ModelCost],
    capped: bool,
) -> str | None:
    """The GPU whose move to ``model`` helps it most without leaving the model it
    comes from busier than ``model`` was, if by more than the hysteresis margin."""
    before = _load(model, demand, cap)
    best: tuple[float, str] | None = None
    for g in gpus:
        donor = primary[g.id]
        if donor == model or not _fits(g, model, costs):
            continue
        if capped and (donor is None or costs[donor].capability != costs[model].capability):
            continue  # the capability may not take one more GPU
        after = dict(cap)
        after[model] = after.get(model, 0.0) + speed[g.id]
        if donor is not None:
            after[donor] -= speed[g.id]
        worst = max(_load(model, demand, after), _load(donor, demand, after) if donor else 0.0)
        if best is None or worst < best[0]:
            best = (worst, g.id)
    if best is None or not best[0] < before * (1 - HYSTERESIS):
        return None
    return best[1]


def _cover_capped(
    gpus: Sequence[GpuView],
    primary: dict[str, str | None],
    wanted: Sequence[str],
    costs: Mapping[str, ModelCost],
    caps: Mapping[str, int],
) -> None:
    """A capped model lives only where it is primary, so one with demand and no GPU
    takes the slowest GPU whose primary can stay warm beside another GPU's."""

    def fits_beside(model: str, host: GpuView) -> bool:
        other = primary[host.id]
        room = host.vram_total_bytes - (costs[other].vram_bytes if other else 0)
        return not host.vram_total_bytes or costs[model].vram_bytes <= room

    held = set(primary.values())
    for model in wanted:
        if costs[model].capability not in caps or model in held:
            continue
        for g in sorted(gpus, key=lambda g: g.speed):
            donor = primary[g.id]
            if not _fits(g, model, costs) or (donor is not None and costs[donor].capability in caps):
                continue
            if donor is None or any(h.id != g.id and _fits(h, donor, costs) and fits_beside(donor, h) for h in gpus):
                primary[g.id] = model
                held.add(model)
                break


def _swap_pass(
    gpus: Sequence[GpuView],
    primary: dict[str, str | None],
    speed: Mapping[str, float],
    demand: Mapping[str, float],
    wanted: Sequence[str],
    costs: Mapping[str, ModelCost],
) -> None:
    """Moving one GPU at a time gives the neediest model the fastest GPU; swapping
    two GPUs' primaries can then balance better (a slow GPU is enough for a
    model whose GPUs cannot serve anything else). Swaps count only past the
    hysteresis margin."""

    def worst() -> float:
        cap: dict[str, float] = {}
        for gid, m in primary.items():
            if m is not None:
                cap[m] = cap.get(m, 0.0) + speed[gid]
        return max((_load(m, demand, cap) for m in wanted), default=0.0)

    for _ in range(len(gpus)):
        before = worst()
        best: tuple[float, GpuView, GpuView] | None = None
        for a in gpus:
            for b in gpus:
                ma, mb = primary[a.id], primary[b.id]
                if a.id >= b.id or ma == mb or ma is None or mb is None:
                    continue
                if not (_fits(a, mb, costs) and _fits(b, ma, costs)):
                    continue
                primary[a.id], primary[b.id] = mb, ma
                after = worst()
                primary[a.id], primary[b.id] = ma, mb
                if best is None or after < best[0]:
                    best = (after, a, b)
        if best is None or not best[0] < before * (1 - HYSTERESIS):
            return
        _, a, b = best
        primary[a.id], primary[b.id] = primary[b.id], primary[a.id]


def plan_warm_sets(
    demand: Mapping[str, float],
    gpus: Sequence[GpuView],
    costs: Mapping[str, ModelCost],
    caps: Mapping[str, int] | None = None,
    *,
    best_effort: frozenset[str] = frozenset(),
) -> dict[str, WarmSet]:
    """``caps``: at most this many GPUs give their primary slot to a capability.
    ``best_effort``: models whose work has no latency target; like capped ones
    they are planned only where they are primary, so the GPUs they hold are the
    share of the fleet the latency-bound work does not need."""
    caps = caps or {}
    usable = [g for g in gpus if g.state == WorkerStatus.READY]
    wanted = [m for m in sorted(demand, key=lambda m: -demand[m]) if demand[m] > 0 and m in costs]
    primary = _starting_primaries(usable, wanted, costs, caps)
    _move_primaries(usable, primary, demand, wanted, costs, caps)
    _swap_pass(usable, primary, {g.id: g.speed for g in usable}, demand, wanted, costs)
    _cover_capped(usable, primary, wanted, costs, caps)
    return {g.id: _warm_set(g, primary[g.id], demand, wanted, costs, caps, best_effort) for g in usable}


def _starting_primaries(
    usable: Sequence[GpuView], wanted: Sequence[str], costs: Mapping[str, ModelCost], caps: Mapping[str, int]
) -> dict[str, str | None]:
    """Each GPU's primary model to start from: the last plan's, or what is loaded
    (moves cost loads), with the slowest holders of a capability over its cap freed."""
    primary: dict[str, str | None] = {}
    for g in usable:
        if g.primary is not None and g.primary in wanted and _fits(g, g.primary, costs):
            primary[g.id] = g.primary
            continue
        current = [m for m in wanted if m in g.warm_models and _fits(g, m, costs)]
        primary[g.id] = current[0] if current else None
    for capability, limit in caps.items():
        holders = [g for g in usable if _capability(primary[g.id], costs) == capability]
        for g in sorted(holders, key=lambda g: -g.speed)[limit:]:
            primary[g.id] = None
    return primary


def _move_primaries(
    usable: Sequence[GpuView],
    primary: dict[str, str | None],
    demand: Mapping[str, float],
    wanted: Sequence[str],
    costs: Mapping[str, ModelCost],
    caps: Mapping[str, int],
) -> None:
    """Gives, one move at a time, the busiest model that can still be helped the
    GPU that helps it most, until no move helps."""
    speed = {g.id: g.speed for g in usable}

    def capacity() -> dict[str, float]:
        cap: dict[str, float] = {}
        for gid, m in primary.items():
            if m is not None:
                cap[m] = cap.get(m, 0.0) + speed[gid]
        return cap

    def capped(model: str) -> bool:
        limit = caps.get(costs[model].capability)
        held = sum(1 for m in primary.values() if m is not None and costs[m].capability == costs[model].capability)
        return limit is not None and held >= limit

    for _ in range(len(usable) * max(len(wanted), 1)):
        cap = capacity()
        move = None
        for model in sorted(wanted, key=lambda m: -_load(m, demand, cap)):
            move = _best_move(model, usable, primary, speed, cap, demand, costs, capped(model))
            if move is not None:
                break
        if move is None:
            break
        primary[move] = model


def _warm_set(
    g: GpuView,
    first: str | None,
    demand: Mapping[str, float],
    wanted: Sequence[str],
    costs: Mapping[str, ModelCost],
    caps: Mapping[str, int],
    best_effort: frozenset[str],
) -> WarmSet:
    """The primary, and the room left filled, keeping what is already loaded
    before loading more; capped and best-effort models live only where they are
    primary."""
    chosen = [first] if first is not None else []
    used = sum(costs[m].vram_bytes for m in chosen)
    for m in sorted(wanted, key=lambda m: (m not in g.warm_models, -demand[m])):
        if m in chosen or not _fits(g, m, costs) or costs[m].capability in caps or m in best_effort:
            continue
        if not g.vram_total_bytes or used + costs[m].vram_bytes <= g.vram_total_bytes:
            chosen.append(m)
            used += costs[m].vram_bytes
    return WarmSet(first, frozenset(chosen))
