"""The denoising loop every diffusers family shares, run step by step over a batch
of jobs; each family (``unet_denoiser``, ``wan_denoiser``, ``upscale_denoiser``)
says how its pipeline loads, what shape its latents have, how a prompt is encoded
and how one step's noise is predicted.

Each member keeps its own noise (its seeds), its own noise-scheduler state, its own
progress and its own stop: a cancelled or timed-out member leaves at the next step
and the rest go on. On a GPU the network's calls of the members at the same step
are fused into one; on a CPU each member's call runs on its own rows, because CPU
kernels block matrix products differently for different batch sizes and only then
is a batched output exactly the one the job would get alone.

A member given a checkpoint starts from its step, with its own step index, beside
members that start from 0; an edit starts at the step its strength gives, from its
input image's latents noised to that step, and an inpainting member keeps the
input outside its mask at every step, as diffusers' pipelines do for a model of
four latent channels. What resuming needs beyond the latents (an edit's input
latents, its mask, its first noise) travels in the checkpoint. Resuming gives
exactly the uninterrupted output on a CPU (on a GPU, what rerunning the job would
give there).

The GPU never waits for the host inside the loop: the noise schedulers decide on the
host (``noise_schedulers``), progress and stops are host flags, and nothing is read
back but at a boundary a member asks for (a preview, a checkpoint, a suspension) and
at its end; a test runs the loop on the meta device, where any read back fails."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu_worker.checkpoint_capture import LoopState, MemberCheckpoints, MemberRun, Resumption
from gpu_worker.denoising import BadOutput, BatchMember, MemberInputs, MemberResult, check_output
from gpu_worker.network_calls import NetworkCalls, warm_up_buckets
from gpu_worker.noise_schedulers import HOST, host_scheduler, keep_unmasked, start_from_input
from gpu_worker.prompts import Conditioning, PromptCache, prompt_key
from services.generation import BatchKey, GenerationParams
from services.models import loader, speed
from services.models.loader import Loaded
from services.models.registry import ModelSpec, scheduler_class


@dataclass
class DiffusersRun(MemberRun):
    conditioning: Conditioning = field(default_factory=Conditioning.empty)
    # Its scheduler's timesteps on the device, for the network: copied once.
    network_timesteps: torch.Tensor = field(default_factory=lambda: torch.empty(0))


class DiffusersDenoiser:
    """A family of diffusers pipelines whose denoising network is ``network_name``."""

    loads_weights = True
    network_name = "unet"

    def __init__(self, models_dir: Path, device: torch.device, prompts: PromptCache) -> None:
        self.models_dir = models_dir
        self.device = device
        self.prompts = prompts
        # Batches are fused into one network call on an accelerator. The meta device
        # stands for one in a test, and has no generators: its noise comes from the CPU.
        self.fuse_batches = device.type != "cpu"
        self.generator_device = HOST if device.type == "meta" else device

    # -- what a family says --------------------------------------------------------

    def pipeline_parts(self, spec: ModelSpec) -> dict[str, Any]:
        """Components to load as given rather than from the model: the VAE lives in
        its own service, so the sampler never loads it."""
        return {"vae": None}

    def latent_shape(self, pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        scale = pipe.vae_scale_factor
        return (params.num_images, self.network(pipe).config.in_channels, params.height // scale, params.width // scale)

    def encode_prompt(self, pipe: Any, spec: ModelSpec, params: GenerationParams, cfg: bool) -> Conditioning:
        return Conditioning.encode(pipe, spec.family, params, self.device, cfg)

    def model_input(self, run: DiffusersRun, latents: torch.Tensor) -> torch.Tensor:
        """What the network takes for a member's (scaled) latents."""
        return latents

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        return pipe.unet(
            x, t, encoder_hidden_states=c.embeds, added_cond_kwargs=c.added_cond_kwargs(), return_dict=False
        )[0]

    def start(self, pipe: Any, run: DiffusersRun, member: BatchMember) -> None:
        """A fresh member's state at its first step: its noise drawn, and an edit's
        input noised to the step its strength starts at."""
        state = _state(run)
        noise = self.draw_noise(pipe, member.params, state)
        inputs = member.inputs
        if inputs is None or inputs.image_latents is None:
            state.latents = noise * state.scheduler.init_noise_sigma
            return
        image = inputs.image_latents.to(self.device, noise.dtype).repeat(member.params.num_images, 1, 1, 1)
        mask = inputs.mask.to(self.device, noise.dtype) if inputs.mask is not None else None
        run.step = start_from_input(state, member.params, image, mask, noise)

    # -- the loop ------------------------------------------------------------------

    def network(self, pipe: Any) -> Any:
        return getattr(pipe, self.network_name)

    def load(self, spec: ModelSpec) -> Loaded:
        from diffusers import DiffusionPipeline

        dtype = loader.compute_dtype(spec, self.device)
        parts = self.pipeline_parts(spec)
        loaded = loader.load(DiffusionPipeline, spec, self.models_dir, self.device, dtype=dtype, **parts)
        pipe = loaded.value
        pipe.set_progress_bar_config(disable=True)
        options = speed.SpeedOptions.of(spec, self.device)
        self.prepare_network(pipe, spec, options)
        if options.compile:
            warm_up_buckets(self, pipe, spec, self._max_rows(spec))
        return loaded

    def prepare_network(self, pipe: Any, spec: ModelSpec, options: speed.SpeedOptions) -> None:
        """The denoising network with the model's speed options applied."""
        setattr(pipe, self.network_name, speed.prepare(self.network(pipe), options))

    def _max_rows(self, spec: ModelSpec) -> int:
        """The most rows one network call takes (before guidance doubles them): a
        batch's images where batches are fused, one member's elsewhere."""
        return spec.max_batch if self.fuse_batches else min(spec.max_images, spec.max_batch)

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        return None  # an upscaler's: its input

    def sample(
        self, pipe: Any, spec: ModelSpec, members: Sequence[BatchMember], checkpoints: MemberCheckpoints
    ) -> list[MemberResult]:
        runs = self.denoise(pipe, spec, members, checkpoints)
        for run in runs:
            if run.result is None and run.state is not None:
                # The one read back a member needs; its check then costs the device nothing.
                latents = run.state.latents.to(HOST, torch.float32)
                try:
                    check_output(latents, spec.min_output_std)
                    run.result = latents
                except BadOutput as exc:
                    run.result = exc
        return [r.result if r.result is not None else RuntimeError("no result") for r in runs]

    def denoise(
        self, pipe: Any, spec: ModelSpec, members: Sequence[BatchMember], checkpoints: MemberCheckpoints
    ) -> list[DiffusersRun]:
        """The members prepared and stepped to their ends, their latents left on the
        device: nothing read back but what a member's boundaries ask for."""
        calls = NetworkCalls(speed.SpeedOptions.of(spec, self.device), self._max_rows(spec))
        with torch.inference_mode():
            runs = [self._prepare(pipe, spec, m, checkpoints) for m in members]
            self._denoise(pipe, members[0].params.key, [r for r in runs if r.result is None], checkpoints, calls)
        return runs

    def _prepare(self, pipe: Any, spec: ModelSpec, member: BatchMember, checkpoints: MemberCheckpoints) -> DiffusersRun:
        """The member at its first step: resumed from its checkpoint if that fits, its
        prompt encoded (or cached) and, unless resumed, started afresh."""
        params = member.params
        state = self._fresh_state(pipe, spec, params)
        run = DiffusersRun.fresh(member, type(state.scheduler).__name__, len(state.scheduler.timesteps), state)
        run.network_timesteps = state.scheduler.timesteps.to(self.device)
        resumed = Resumption.STEP
        if member.resume is not None:
            latents = (self.latent_shape(pipe, params), self.network(pipe).dtype)
            resumed = checkpoints.resume(run, member.resume, latents)
            if resumed is Resumption.REFUSED:
                run.state = self._fresh_state(pipe, spec, params)  # restoring may have changed it
        if member.stopping.is_set():
            run.result = checkpoints.stopped(run)
            return run
        try:
            run.conditioning = self.encode_cached(pipe, spec, params)
            if resumed is not Resumption.LATENTS:
                self.start(pipe, run, member)
        except Exception as exc:  # this member's inputs: it fails alone
            run.result = exc
        return run

    def encode_prompts(self, pipe: Any, spec: ModelSpec, batch: Sequence[GenerationParams]) -> None:
        for params in batch:
            self.encode_cached(pipe, spec, params)

    def encode_cached(self, pipe: Any, spec: ModelSpec, params: GenerationParams) -> Conditioning:
        """The job's prompt conditioning, from the prompt cache or encoded into it."""
        cfg = params.guidance_scale > 1.0
        with torch.inference_mode():
            return self.prompts.get(prompt_key(params), lambda: self.encode_prompt(pipe, spec, params, cfg))

    def draw_noise(self, pipe: Any, params: GenerationParams, state: LoopState) -> torch.Tensor:
        """One draw per output from its own generator, as the diffusers pipelines do."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (1, *self.latent_shape(pipe, params)[1:])
        dtype = self.network(pipe).dtype
        return torch.cat([randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in state.generators])

    def _fresh_state(self, pipe: Any, spec: ModelSpec, params: GenerationParams) -> LoopState:
        """A new noise scheduler set to the job's steps, and each output's generator
        seeded: the state of a job at step 0, before its noise is drawn."""
        scheduler = host_scheduler(scheduler_class(spec) if spec.scheduler else type(pipe.scheduler), pipe, params)
        seeds = [(params.seed + i) % 2**63 for i in range(params.num_images)]
        generators = [torch.Generator(device=self.generator_device).manual_seed(seed) for seed in seeds]
        return LoopState(torch.empty(0), scheduler, generators)

    def _denoise(
        self,
        pipe: Any,
        key: BatchKey,
        runs: list[DiffusersRun],
        checkpoints: MemberCheckpoints,
        calls: NetworkCalls,
    ) -> None:
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
                network_t = group[0].network_timesteps[group[0].step]
                noise = self._predict(pipe, group, t, network_t, key.guidance_scale, calls)
                for r, eps in zip(group, noise, strict=True):
                    state = _state(r)
                    extra = {"generator": state.generators} if takes_generator else {}
                    state.latents = state.scheduler.step(eps, t, state.latents, **extra, return_dict=False)[0]
                    keep_unmasked(state, r.step)
            for r in active:
                r.step += 1
                r.member.on_step(r.step, r.total)
                if r.step in r.member.preview_at and r.member.on_preview is not None:
                    r.member.on_preview(r.step, r.total, _state(r).latents.detach().to("cpu", torch.float32))
                checkpoints.stepped(r)

    def _groups(self, active: list[DiffusersRun]) -> list[list[DiffusersRun]]:
        """The runs that share one network call. Members of a batch share a model,
        its scheduler class and their steps, so the same step index is the same
        timestep; comparing indices spares a device sync per member."""
        if not self.fuse_batches:
            return [[r] for r in active]
        by_step: dict[int, list[DiffusersRun]] = {}
        for r in active:
            by_step.setdefault(r.step, []).append(r)
        return list(by_step.values())

    def _predict(
        self,
        pipe: Any,
        group: list[DiffusersRun],
        t: torch.Tensor,
        network_t: torch.Tensor,
        guidance: float,
        calls: NetworkCalls,
    ) -> list[torch.Tensor]:
        """The guided noise prediction of each run in ``group``, from one network call;
        ``t`` is the step's timestep on the host (for the schedulers), ``network_t``
        the same on the device."""
        states = [_state(r) for r in group]
        scaled = [
            self.model_input(r, s.scheduler.scale_model_input(s.latents, t)) for r, s in zip(group, states, strict=True)
        ]
        sizes = [s.latents.shape[0] for s in states]
        x = torch.cat(scaled)
        c = Conditioning.stack([r.conditioning.rows(s.latents.shape[0]) for r, s in zip(group, states, strict=True)])
        rows = x.shape[0]
        x, c = calls.padded(x, c)
        cfg = guidance > 1.0
        if cfg:
            x = torch.cat([x, x])
            c = Conditioning.stack([c.negative(), c])
        with speed.network_call(calls.options):
            out = speed.owned(self.call_network(pipe, x, network_t, c, group), calls.options)
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        return list(out[:rows].split(sizes))


def _state(run: MemberRun) -> LoopState:
    """A diffusers run's state: it always has one."""
    assert run.state is not None
    return run.state
