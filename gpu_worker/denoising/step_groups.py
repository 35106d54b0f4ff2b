"""How one step of a batch's members becomes network calls: which members share a
call, and each row's timestep and guidance scale in it. Members may differ in their
steps, noise scheduler state and guidance (a job that joined a running batch is at
its own step), so a fused call carries a timestep and a guidance scale per row;
where all members agree it carries one of each, exactly as a batch of one key did."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from gpu_worker.adapters.library import slots_of
from gpu_worker.adapters.slots import MemberAdapters
from gpu_worker.denoising.checkpoint_capture import LoopState
from gpu_worker.denoising.diffusers_run import DiffusersRun, NetworkStep
from gpu_worker.denoising.network_calls import NetworkCalls
from gpu_worker.denoising.noise_schedulers import model_input
from gpu_worker.denoising.parallel_network import gather_halves, split_halves
from gpu_worker.denoising.prompts import Conditioning
from services.generation import GenerationParams
from services.models import speed


def step_groups(
    active: list[DiffusersRun],
    *,
    fuse: bool,
    guided: Callable[[GenerationParams], bool],
    key: Callable[[DiffusersRun], Hashable] = lambda run: None,
) -> list[list[DiffusersRun]]:
    """The runs that share one network call: on an accelerator those of one guidance
    mode (``guided``: the call doubles its rows for classifier-free guidance) and one
    ``key`` (an edit's input image's token grid); on a CPU each run alone, since CPU
    kernels block matrix products differently for other batch sizes, and only alone
    is a member's output exactly its solo one."""
    if not fuse:
        return [[r] for r in active]
    groups: dict[tuple[bool, Hashable], list[DiffusersRun]] = {}
    for r in active:
        groups.setdefault((not guided(r.member.params), key(r)), []).append(r)
    return [groups[k] for k in sorted(groups, key=lambda k: k[0])]


def guided_noise(
    denoiser: NetworkStep, pipe: Any, group: list[DiffusersRun], calls: NetworkCalls
) -> list[torch.Tensor]:
    """The guided noise prediction of each run in ``group`` (one guidance mode), at
    each run's own timestep and guidance scale: from one network call, its rows
    doubled for classifier-free guidance (the negative prompt's first), or, where the
    denoiser says its halves do not share one, from a call for each half; the halves
    combined as the denoiser says (``combine_guidance``)."""
    states = [_state(r) for r in group]
    scaled = [
        denoiser.model_input(r, model_input(s.scheduler, s.latents, s.scheduler.timesteps[r.step]))
        for r, s in zip(group, states, strict=True)
    ]
    sizes = [s.latents.shape[0] for s in states]
    x = torch.cat(scaled)
    c = Conditioning.stack([r.conditioning.rows(n) for r, n in zip(group, sizes, strict=True)])
    rows = x.shape[0]
    x, c = calls.padded(x, c)
    t = network_timesteps(group, sizes, len(x), per_row=calls.options.compile)
    cfg = denoiser.classifier_free(group[0].member.params)
    adapters = _adapter_rows(group, sizes, len(x))
    if not cfg:
        return list(_call(denoiser, pipe, x, t, c, group, calls, adapters)[:rows].split(sizes))
    if split_halves(calls.group):
        assert calls.group is not None
        mine = c.negative() if calls.group.cfg_rank == 0 else c
        uncond, cond = gather_halves(calls.group, _call(denoiser, pipe, x, t, mine, group, calls, adapters))
    elif denoiser.halves_share_call:
        doubled = Conditioning.stack([c.negative(), c])
        both = t if t.dim() == 0 else torch.cat([t, t])
        call = _call(denoiser, pipe, torch.cat([x, x]), both, doubled, group, calls, adapters * 2)
        uncond, cond = call.chunk(2)
    else:
        uncond = _call(denoiser, pipe, x, t, c.negative(), group, calls, adapters)
        cond = _call(denoiser, pipe, x, t, c, group, calls, adapters)
    out = denoiser.combine_guidance(pipe, uncond, cond, row_scales(group, sizes, len(uncond), uncond))
    return list(out[:rows].split(sizes))


def _call(
    denoiser: NetworkStep,
    pipe: Any,
    x: torch.Tensor,
    t: torch.Tensor,
    c: Conditioning,
    group: list[DiffusersRun],
    calls: NetworkCalls,
    adapters: Sequence[MemberAdapters],
) -> torch.Tensor:
    """One network call, with the speed options and each row's adapters around it."""
    slots = slots_of(pipe)
    with speed.network_call(calls.options), slots.rows(adapters) if slots else contextlib.nullcontext():
        return speed.owned(denoiser.call_network(pipe, x, t, c, group), calls.options)


def _adapter_rows(group: Sequence[DiffusersRun], sizes: Sequence[int], rows: int) -> list[MemberAdapters]:
    """Each of a call's ``rows`` rows' adapters: each member's on its own rows,
    padding rows none."""
    table: list[MemberAdapters] = [r.adapters for r, n in zip(group, sizes, strict=True) for _ in range(n)]
    return table + [()] * (rows - len(table))


def network_timesteps(
    group: Sequence[DiffusersRun], sizes: Sequence[int], rows: int, *, per_row: bool = False
) -> torch.Tensor:
    """The timestep the network takes for ``group``'s ``rows`` (padding included):
    one, on the device, where every run is at the same timestep (unless ``per_row``:
    a compiled network, warmed up with one per row, always takes one per row, so a
    joiner never costs it a recompilation); else one per row, gathered on the device
    (the host decides from its own tables, never reading the device back), padding
    rows given the last."""
    host = [float(_timesteps(r)[r.step]) for r in group]
    if not per_row and all(t == host[0] for t in host):
        return group[0].network_timesteps[group[0].step]
    t = torch.cat([r.network_timesteps[r.step : r.step + 1].expand(n) for r, n in zip(group, sizes, strict=True)])
    return torch.cat([t, t[-1:].expand(rows - len(t))]) if rows > len(t) else t


def row_scales(
    group: Sequence[DiffusersRun], sizes: Sequence[int], rows: int, like: torch.Tensor
) -> float | torch.Tensor:
    """Each row's guidance scale, shaped to multiply ``like``'s rows: one number where
    every member has the same (a batch of one key), else ``guidance_column``."""
    guidance = [r.member.params.guidance_scale for r in group]
    if all(g == guidance[0] for g in guidance):
        return guidance[0]
    column = guidance_column(group, sizes, rows)
    return column.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def guidance_column(group: Sequence[DiffusersRun], sizes: Sequence[int], rows: int) -> torch.Tensor:
    """Each of ``rows`` rows' guidance scale, gathered on the device from each
    member's own (``sizes``: its rows), padding rows given the last."""
    column = torch.cat([r.network_guidance.expand(n) for r, n in zip(group, sizes, strict=True)])
    if rows > len(column):
        column = torch.cat([column, column[-1:].expand(rows - len(column))])
    return column


_TAKES_GENERATOR: dict[str, bool] = {}


def takes_generator(scheduler: Any) -> bool:
    """Whether the scheduler's ``step`` draws noise (and so takes the member's generators)."""
    name = type(scheduler).__qualname__
    known = _TAKES_GENERATOR.get(name)
    if known is None:
        known = _TAKES_GENERATOR[name] = "generator" in inspect.signature(scheduler.step).parameters
    return known


def _state(run: DiffusersRun) -> LoopState:
    assert run.state is not None
    return run.state


def _timesteps(run: DiffusersRun) -> torch.Tensor:
    return _state(run).scheduler.timesteps
