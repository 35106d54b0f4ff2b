"""A loaded network split across its group, as its ``parallel`` shape says: the
sequence by diffusers' own context-parallel plan (the hooks that shard its inputs at
its entry and gather its output, and the Ulysses all-to-all inside each attention),
and guidance's two halves by ``guided_noise`` (``split_halves``: each rank computes
its half, the halves gathered once a step)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gpu_worker.denoising.group_mesh import GroupError, ShapeMesh


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
