"""The diffusers families (sd15, sdxl, tiny): text encoders, a UNet and a noise
scheduler, run step by step over a batch of jobs.

Each member keeps its own noise (its seeds), its own noise-scheduler state, its own
progress and its own stop: a cancelled or timed-out member leaves at the next step
and the rest go on. On a GPU the UNet calls of the members at the same step are
fused into one; on a CPU each member's call runs on its own rows, because CPU
kernels block matrix products differently for different batch sizes and only then
is a batched image exactly the one the job would get alone.

A member given a checkpoint starts from its step, with its own step index, beside
members that start from 0. Resuming gives exactly the uninterrupted image on a CPU
(on a GPU, what rerunning the job would give there)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu_worker.checkpoint_capture import LoopState, MemberCheckpoints, MemberRun, Resumption
from gpu_worker.denoising import BadOutput, BatchMember, MemberResult, check_output
from gpu_worker.prompts import Conditioning, PromptCache
from services.generation import BatchKey, GenerationParams
from services.models import loader
from services.models.loader import Loaded
from services.models.registry import ModelFamily, ModelSpec, scheduler_class

# The VAE lives in its own service: the sampler never loads it. SD 1.5's pipelines
# would load a safety checker too; the sampler has no use for one.
_PIPELINE_PARTS: dict[ModelFamily, dict[str, Any]] = {
    ModelFamily.SD15: {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False},
    ModelFamily.TINY: {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False},
}


@dataclass
class _UNetRun(MemberRun):
    conditioning: Conditioning = field(default_factory=Conditioning.empty)


class UNetDenoiser:
    loads_weights = True

    def __init__(self, models_dir: Path, device: torch.device, prompts: PromptCache) -> None:
        self.models_dir = models_dir
        self.device = device
        self.prompts = prompts
        self.fuse_batches = device.type == "cuda"

    def load(self, spec: ModelSpec) -> Loaded:
        from diffusers import DiffusionPipeline

        parts = {"vae": None, **_PIPELINE_PARTS.get(spec.family, {})}
        dtype = loader.compute_dtype(spec, self.device)
        loaded = loader.load(DiffusionPipeline, spec, self.models_dir, self.device, dtype=dtype, **parts)
        loaded.value.set_progress_bar_config(disable=True)
        self._apply_speed_options(loaded.value, spec)
        return loaded

    def _apply_speed_options(self, pipe: Any, spec: ModelSpec) -> None:
        if spec.attention:
            from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

            pipe.unet.set_attn_processor(AttnProcessor2_0() if spec.attention == "sdpa" else AttnProcessor())
        if self.device.type != "cuda":
            return  # channels-last and compilation pay off on a GPU only
        if spec.channels_last:
            pipe.unet.to(memory_format=torch.channels_last)
        if spec.compile:
            pipe.unet = torch.compile(pipe.unet, fullgraph=True)

    def sample(
        self, pipe: Any, spec: ModelSpec, members: Sequence[BatchMember], checkpoints: MemberCheckpoints
    ) -> list[MemberResult]:
        with torch.inference_mode():
            runs = [self._prepare(pipe, spec, m, checkpoints) for m in members]
            self._denoise(pipe, members[0].params.key, [r for r in runs if r.result is None], checkpoints)
        for run in runs:
            if run.result is None and run.state is not None:
                try:
                    check_output(run.state.latents, spec.min_output_std)
                    run.result = run.state.latents.to("cpu", torch.float32)
                except BadOutput as exc:
                    run.result = exc
        return [r.result if r.result is not None else RuntimeError("no result") for r in runs]

    def _prepare(self, pipe: Any, spec: ModelSpec, member: BatchMember, checkpoints: MemberCheckpoints) -> _UNetRun:
        """The member at its first step: resumed from its checkpoint if that fits, its
        prompt encoded (or cached) and, unless resumed, its noise drawn."""
        params = member.params
        state = self._fresh_state(pipe, spec, params)
        run = _UNetRun.fresh(member, type(state.scheduler).__name__, len(state.scheduler.timesteps), state)
        resumed = Resumption.STEP
        if member.resume is not None:
            latents = (self._latent_shape(pipe, params), pipe.unet.dtype)
            resumed = checkpoints.resume(run, member.resume, latents)
            if resumed is Resumption.REFUSED:
                run.state = self._fresh_state(pipe, spec, params)  # restoring may have changed it
        if member.stopping.is_set():
            run.result = checkpoints.stopped(run)
            return run
        try:
            cfg = params.guidance_scale > 1.0
            run.conditioning = self.prompts.get(
                (params.model, params.prompt, params.negative_prompt, cfg, params.width, params.height),
                lambda: Conditioning.encode(pipe, spec.family, params, self.device, cfg),
            )
            if resumed is not Resumption.LATENTS:
                self._draw_noise(pipe, params, _state(run))
        except Exception as exc:  # this member's inputs: it fails alone
            run.result = exc
        return run

    def _draw_noise(self, pipe: Any, params: GenerationParams, state: LoopState) -> None:
        from diffusers.utils.torch_utils import randn_tensor

        shape = (1, *self._latent_shape(pipe, params)[1:])
        # One draw per image from its own generator, as the diffusers pipelines do.
        dtype = pipe.unet.dtype
        noise = [randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in state.generators]
        state.latents = torch.cat(noise) * state.scheduler.init_noise_sigma

    def _fresh_state(self, pipe: Any, spec: ModelSpec, params: GenerationParams) -> LoopState:
        """A new noise scheduler set to the job's steps, and each image's generator
        seeded: the state of a job at step 0, before its noise is drawn."""
        cls = scheduler_class(spec) if spec.scheduler else type(pipe.scheduler)
        scheduler = cls.from_config(pipe.scheduler.config)
        scheduler.set_timesteps(params.steps, device=self.device)
        seeds = [(params.seed + i) % 2**63 for i in range(params.num_images)]
        generators = [torch.Generator(device=self.device).manual_seed(seed) for seed in seeds]
        return LoopState(torch.empty(0), scheduler, generators)

    @staticmethod
    def _latent_shape(pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        scale = pipe.vae_scale_factor
        return (params.num_images, pipe.unet.config.in_channels, params.height // scale, params.width // scale)

    def _denoise(self, pipe: Any, key: BatchKey, runs: list[_UNetRun], checkpoints: MemberCheckpoints) -> None:
        """Steps every run to its end, one step of each per round, each at its own
        step index: a resumed member finishes before a fresh one beside it."""
        if not runs:
            return
        takes_generator = "generator" in inspect.signature(_state(runs[0]).scheduler.step).parameters
        checkpoints.mark(runs)
        while True:
            active = [r for r in runs if r.result is None and r.step < r.total]
            for r in active:
                if r.member.stopping.is_set():
                    r.result = checkpoints.stopped(r)
            active = [r for r in active if r.result is None]
            if not active:
                return
            for group in self._groups(active):
                t = _state(group[0]).scheduler.timesteps[group[0].step]
                noise = self._predict(pipe, group, t, key.guidance_scale)
                for r, eps in zip(group, noise, strict=True):
                    state = _state(r)
                    extra = {"generator": state.generators} if takes_generator else {}
                    state.latents = state.scheduler.step(eps, t, state.latents, **extra, return_dict=False)[0]
            for r in active:
                r.step += 1
                r.member.on_step(r.step, r.total)
                checkpoints.stepped(r)

    def _groups(self, active: list[_UNetRun]) -> list[list[_UNetRun]]:
        """The runs that share one UNet call. Members of a batch share a model, its
        scheduler class and their steps, so the same step index is the same
        timestep; comparing indices spares a device sync per member."""
        if not self.fuse_batches:
            return [[r] for r in active]
        by_step: dict[int, list[_UNetRun]] = {}
        for r in active:
            by_step.setdefault(r.step, []).append(r)
        return list(by_step.values())

    def _predict(self, pipe: Any, group: list[_UNetRun], t: torch.Tensor, guidance: float) -> list[torch.Tensor]:
        """The guided noise prediction of each run in ``group``, from one UNet call."""
        states = [_state(r) for r in group]
        scaled = [s.scheduler.scale_model_input(s.latents, t) for s in states]
        sizes = [s.shape[0] for s in scaled]
        x = torch.cat(scaled)
        c = Conditioning.stack([r.conditioning.rows(s.latents.shape[0]) for r, s in zip(group, states, strict=True)])
        cfg = guidance > 1.0
        if cfg:
            x = torch.cat([x, x])
            c = Conditioning.stack([c.negative(), c])
        out = pipe.unet(
            x, t, encoder_hidden_states=c.embeds, added_cond_kwargs=c.added_cond_kwargs(), return_dict=False
        )[0]
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        return list(out.split(sizes))


def _state(run: MemberRun) -> LoopState:
    """A diffusers run's state: it always has one."""
    assert run.state is not None
    return run.state
