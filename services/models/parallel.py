"""How one replica of a model spreads over several GPUs (a registry entry's
``parallel = { sequence = 2, cfg = 2 }``), and which families take which mode.

- ``sequence``: Ulysses context parallelism through diffusers' own ``_cp_plan`` (the
  network's tokens split across ranks, its attention heads exchanged by an all-to-all
  around each attention); the weights are replicated.
- ``cfg``: classifier-free guidance's two halves computed on two ranks and gathered
  once a step; the weights are replicated.
- ``tensor``: the weights split (the way a model bigger than a card loads), in one of
  two forms (``splits_heads``). By heads, through diffusers' own ``_tp_plan`` (Flux.1
  and Qwen-Image): each block's projections split by columns and rows, each rank
  attending over its share of the heads, the compute split with the weights. By
  blocks, for every other family and where the heads cannot be split (a model that
  takes adapters, or splits its sequence too): each of the network's blocks sharded
  across the ranks and gathered as it runs (FSDP2's ``fully_shard``); the compute is
  replicated. Both run over gloo as over NCCL. Combines with ``cfg`` and
  ``sequence``: each sequence (or guidance) rank's weights sharded over the ranks of
  its ``tensor`` row.

The product of the degrees is the group's size: the number of GPUs of one replica."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Families (``ModelFamily`` values) whose diffusers network carries a context-parallel plan (``_cp_plan``) and
# whose attention goes through diffusers' dispatcher, where the plan's all-to-all runs.
SEQUENCE_FAMILIES = frozenset({"flux", "flux_kontext", "qwen_image", "qwen_image_edit", "wan"})
# Families that guide with a negative prompt's prediction: two network halves a step.
CFG_FAMILIES = frozenset({"tiny", "sd15", "sdxl", "sd3", "wan", "qwen_image", "qwen_image_edit", "z_image"})
# Why a family refuses a mode: said in the registry's error and in docs/parallel.md.
_NO_SEQUENCE = (
    "its network has no context-parallel plan (diffusers ships them for Flux.1, Qwen-Image and Wan; "
    "SD 3.5's and Z-Image's attention processors call SDPA directly and the UNets attend per resolution)"
)
_NO_CFG = "it makes one prediction a step (guidance-distilled or unguided): there are no halves to split"
# Families whose network is a diffusers model with blocks to shard (``_no_split_modules``).
TENSOR_FAMILIES = SEQUENCE_FAMILIES | CFG_FAMILIES
# Families whose network carries diffusers' tensor-parallel plan (``_tp_plan``): its
# heads and projections split across the ``tensor`` ranks.
HEAD_FAMILIES = frozenset({"flux", "flux_kontext", "qwen_image", "qwen_image_edit"})
_NO_TENSOR = "it has no diffusers network of blocks to shard"
MAX_DEGREE = 8


class ParallelError(ValueError):
    """A registry entry's ``parallel`` table that cannot be served."""


@dataclass(frozen=True)
class Parallelism:
    """One replica's degrees: 1 each for a model that runs on one GPU."""

    sequence: int = 1
    cfg: int = 1
    tensor: int = 1

    @property
    def size(self) -> int:
        """The GPUs one replica takes."""
        return self.sequence * self.cfg * self.tensor

    @property
    def grouped(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        """``sequence=2,cfg=2``; ``single`` for a model of one GPU."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) > 1]
        return ",".join(parts) or "single"

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) > 1}

    @classmethod
    def parse(cls, text: str) -> Parallelism:
        """The inverse of ``describe``."""
        if text in ("", "single"):
            return cls()
        table: dict[str, Any] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or not value.strip().isdigit():
                raise ParallelError(f"parallel {text!r}: each part is MODE=DEGREE, not {part!r}")
            table[key.strip()] = int(value)
        return cls.of(table)

    @classmethod
    def of(cls, table: Mapping[str, Any]) -> Parallelism:
        """A registry entry's ``parallel`` table, its keys and degrees checked."""
        if not isinstance(table, Mapping):
            raise ParallelError(f"parallel must be a table such as {{ sequence = 2 }}, not {table!r}")
        modes = [f.name for f in fields(cls)]
        unknown = sorted(set(table) - set(modes))
        if unknown:
            raise ParallelError(f"parallel: unknown modes {unknown}; modes: {modes}")
        for mode, degree in table.items():
            if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= MAX_DEGREE:
                raise ParallelError(f"parallel.{mode} must be a whole number within 1..{MAX_DEGREE}, not {degree!r}")
        shape = cls(**table)
        if shape.cfg not in (1, 2):
            raise ParallelError(f"parallel.cfg splits guidance's two halves: it is 1 or 2, not {shape.cfg}")
        if shape.size > MAX_DEGREE:
            raise ParallelError(f"parallel: a replica of {shape.size} GPUs is more than {MAX_DEGREE}")
        return shape


SINGLE = Parallelism()


def shapes_of(size: int) -> list[Parallelism]:
    """Every parallel shape of ``size`` GPUs, which a group of that size serves: its
    sequence split and its weights sharded; for an even size, guidance's halves times
    half of either; then the products of sharded weights and a split sequence (with
    guidance's halves or not)."""
    found = [Parallelism(sequence=size), Parallelism(tensor=size)]
    if size % 2 == 0:
        found += [Parallelism(sequence=size // 2, cfg=2), Parallelism(cfg=2, tensor=size // 2)]
    for cfg in (1, 2):
        rest = size // cfg if size % cfg == 0 else 0
        found += [Parallelism(sequence=rest // t, cfg=cfg, tensor=t) for t in range(2, rest) if rest % t == 0]
    return list(dict.fromkeys(found))  # a group of 2: cfg=2 once


def splits_heads(family: str, shape: Parallelism, adapter_slots: int) -> bool:
    """Whether a ``tensor`` model is split by heads (diffusers' plan) rather than by
    blocks: where its family has a plan, it takes no adapters (an adapter's layer
    wraps the whole projection a plan splits) and does not split its sequence too
    (Ulysses would then split each rank's share of the heads again)."""
    return shape.tensor > 1 and family in HEAD_FAMILIES and not adapter_slots and shape.sequence == 1


def refusal(family: str, shape: Parallelism) -> str | None:
    """Why ``family`` cannot run as ``shape``; None where it can."""
    if shape.tensor > 1 and family not in TENSOR_FAMILIES:
        return f"parallel.tensor: a {family} model cannot shard its weights: {_NO_TENSOR}"
    if shape.sequence > 1 and family not in SEQUENCE_FAMILIES:
        return f"parallel.sequence: a {family} model cannot split its sequence: {_NO_SEQUENCE}"
    if shape.cfg > 1 and family not in CFG_FAMILIES:
        return f"parallel.cfg: a {family} model cannot split its guidance: {_NO_CFG}"
    return None
