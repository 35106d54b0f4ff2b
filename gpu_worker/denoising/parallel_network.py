"""A loaded network split across its group, as its ``parallel`` shape says: the
sequence by diffusers' own context-parallel plan (the hooks that shard its inputs at
its entry and gather its output, and the Ulysses all-to-all inside each attention),
its weights by diffusers' tensor-parallel plan (``split_heads``) or block by block
(``shard_network``), and guidance's two halves by ``guided_noise`` (``split_halves``:
each rank computes its half, the halves gathered once a step)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from gpu_worker.denoising.group_mesh import GroupError, ShapeMesh
from services.models.parallel import splits_heads
from services.models.spec import ModelSpec

log = logging.getLogger(__name__)


def split_network(network: Any, mesh: ShapeMesh) -> None:
    """Applies the group's sequence split to ``network`` (no collective: the mesh was
    built as the group formed)."""
    if mesh.context_parallel is None:
        return
    from diffusers.hooks.context_parallel import apply_context_parallel

    plan = getattr(network, "_cp_plan", None)
    if plan is None:
        raise GroupError(f"{type(network).__name__} has no context-parallel plan: it cannot split its sequence")
    heads = getattr(network.config, "num_attention_heads", None)
    degree = mesh.shape.sequence
    if isinstance(heads, int) and heads % degree:
        raise GroupError(f"{type(network).__name__} has {heads} attention heads: {degree} ranks cannot share them out")
    config = mesh.context_parallel
    for module in network.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    network._parallel_config = config
    apply_context_parallel(network, config.context_parallel_config, plan)


def shard_weights(network: Any, spec: ModelSpec, mesh: ShapeMesh, device: torch.device) -> None:
    """``network``'s weights split over the group's ``tensor`` ranks: by heads or by
    blocks, as ``splits_heads`` says for ``spec``."""
    by_heads = splits_heads(spec.family, spec.parallel, spec.adapter_slots)
    (split_heads if by_heads else shard_network)(network, mesh, device)


def split_heads(network: Any, mesh: ShapeMesh, device: torch.device) -> None:
    """Splits ``network`` (on the host, whole, as it loaded) over the group's ``tensor``
    ranks by diffusers' own tensor-parallel plan (``_tp_plan``): each block's
    projections by columns and then rows (one all-reduce after each attention's and
    each feed-forward's), each rank attending over its share of the heads; the rest
    (embeddings, norms, modulation) replicated, then moved to ``device``. Through the
    plan's own parts rather than ``enable_parallelism``, which refuses a CPU's gloo
    (its device list) and takes each rank's device to be ``cuda:RANK``."""
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles, resolve_tp_shard_specs
    from torch.distributed.tensor.parallel import parallelize_module

    plan = getattr(type(network), "_tp_plan", None)
    if mesh.shard_mesh is None or plan is None:
        raise GroupError(f"{type(network).__name__} has no tensor-parallel plan: it cannot split its heads")
    degree = mesh.shape.tensor
    heads = getattr(network.config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % degree:
        raise GroupError(f"{type(network).__name__} has {heads} attention heads: {degree} ranks cannot share them out")
    resolve_tp_shard_specs(network, plan, degree)  # every split even, checked before any is made
    for block, block_plan in _resolve_tp_plan(network, plan):
        parallelize_module(block, mesh.shard_mesh, _styles(block_plan))
    network.to(device)
    log.info("%s split by heads (diffusers' plan) across %d ranks", type(network).__name__, degree)


def shard_network(network: Any, mesh: ShapeMesh, device: torch.device) -> None:
    """Shards ``network``'s weights over the group's ``tensor`` ranks (it is on the host,
    whole, as it loaded): each of its blocks (diffusers' ``_no_split_modules``, the
    outermost) and then what is left, gathered as each runs and freed after; its
    shards then moved to ``device``."""
    from torch.distributed.fsdp import fully_shard

    if mesh.shard_mesh is None:
        return
    names = set(getattr(network, "_no_split_modules", None) or ())
    if not names:
        raise GroupError(f"{type(network).__name__} names no blocks to shard")
    taken: list[str] = []
    for path, module in network.named_modules():
        if type(module).__name__ in names and not any(path.startswith(t + ".") for t in taken):
            taken.append(path)
            fully_shard(module, mesh=mesh.shard_mesh, reshard_after_forward=True)
    fully_shard(network, mesh=mesh.shard_mesh, reshard_after_forward=True)
    network.to(device)
    log.info("%s sharded by blocks (%d) across %d ranks", type(network).__name__, len(taken), mesh.shape.tensor)


def sequence_degree(network: Any) -> int:
    """The ranks ``network``'s sequence is split over (1: not split)."""
    config = getattr(network, "_parallel_config", None)
    context = getattr(config, "context_parallel_config", None)
    return int(context.ulysses_degree * context.ring_degree) if context is not None else 1


def check_shares(network: Any, tokens: int, width: int, height: int) -> None:
    """A job whose tokens its group's ranks cannot share out evenly fails alone (the
    split network asserts it, failing the whole batch)."""
    degree = sequence_degree(network)
    if degree > 1 and tokens % degree:
        raise GroupError(
            f"a {width}x{height} job is {tokens} tokens to its network: its group's {degree} ranks "
            f"cannot share them out evenly (docs/parallel.md)"
        )


def split_halves(mesh: ShapeMesh | None) -> bool:
    """Whether guidance's halves are computed on two ranks."""
    return mesh is not None and mesh.cfg_group is not None


def gather_halves(mesh: ShapeMesh, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both halves of a guided prediction, from this rank's (``mesh.cfg_rank``: 0 the
    negative prompt's): every rank then combines and steps alike."""
    halves = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(halves, mine.contiguous(), group=mesh.cfg_group)
    return halves[0], halves[1]
