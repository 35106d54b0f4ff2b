"""Wan text to video (``WanPipeline``): a UMT5 text encoder, a 3D transformer over
latents of (16, latent frames, H/8, W/8), and a flow-matching UniPC noise scheduler,
in ``gpu_worker.denoising.diffusers_denoiser``'s loop: a video job is denoised,
checkpointed, suspended and resumed like an image job, its latents one dimension
deeper. Wan 2.2 A14B's two experts (``transformer_2`` and the pipeline's
``boundary_ratio``): a step whose timestep is at or above the boundary is the
high-noise expert's, the rest the low-noise one's, as ``WanPipeline`` switches them.
Members on both sides of it in one step (a job that joined a running batch) never
share a call: each expert has its own call in that step (``call_key``), chosen on the
host from the members' own timesteps, so the loop reads nothing back to choose."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.denoising.checkpoint_capture import MemberRun
from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.prompts import Conditioning
from services.errors import ModelError
from services.generation import GenerationParams
from services.models.device import module_dtype
from services.models.loader import Loaded
from services.models.spec import ModelSpec


class WanDenoiser(DiffusersDenoiser):
    network_name = "transformer"
    more_network_names = ("transformer_2",)

    def load(self, spec: ModelSpec) -> Loaded:
        loaded = super().load(spec)
        if second_expert(loaded.value) is not None and spec.adapter_slots:
            # Slots are the first network's alone: an adapter would adapt the early steps only.
            raise ModelError(f"model {spec.name!r}: a model of two experts takes no adapter_slots yet")
        return loaded

    def step_phase(self, pipe: Any, run: MemberRun) -> int:
        """1 where ``run``'s step is the low-noise expert's, else 0 (from the host's
        timesteps: nothing read back)."""
        assert run.state is not None
        boundary = boundary_timestep(pipe)
        return int(boundary is not None and float(run.state.scheduler.timesteps[run.step]) < boundary)

    def call_key(self, pipe: Any, run: DiffusersRun) -> Any:
        return self.step_phase(pipe, run)

    def latent_shape(self, pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        frames = (params.frames - 1) // pipe.vae_scale_factor_temporal + 1
        scale = pipe.vae_scale_factor_spatial
        channels = pipe.transformer.config.in_channels
        return (params.num_images, channels, frames, params.height // scale, params.width // scale)

    def image_tokens(self, pipe: Any, params: GenerationParams) -> int:
        _, _, frames, h, w = self.latent_shape(pipe, params)
        pf, ph, pw = pipe.transformer.config.patch_size
        return (frames // pf) * (h // ph) * (w // pw)

    def encode_prompt(self, pipe: Any, spec: ModelSpec, params: GenerationParams, cfg: bool) -> Conditioning:
        """In its transformer's dtype, as WanPipeline casts it."""
        encoded = Conditioning.encode(pipe, spec.family, params, self.text_device(pipe), cfg)
        dtype = module_dtype(pipe.transformer)
        return Conditioning.of({name: t.to(dtype) for name, t in encoded.tensors().items()})

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        assert c.embeds is not None
        # A call's members share their step's expert (``call_key``).
        expert = pipe.transformer_2 if self.step_phase(pipe, runs[0]) else pipe.transformer
        return _predict(expert, x, t.expand(x.shape[0]), c.embeds)


def second_expert(pipe: Any) -> Any:
    """Wan 2.2 A14B's low-noise expert; None for a model of one (Wan 2.1)."""
    if getattr(pipe, "transformer_2", None) is None or pipe.config.get("boundary_ratio") is None:
        return None
    return pipe.transformer_2


def boundary_timestep(pipe: Any) -> float | None:
    """The timestep below which a step is the low-noise expert's; None for a model of one."""
    if second_expert(pipe) is None:
        return None
    return float(pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps)


def _predict(network: Any, x: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    prediction: torch.Tensor = network(
        hidden_states=x.to(module_dtype(network)),
        timestep=timestep,
        encoder_hidden_states=embeds,
        return_dict=False,
    )[0]
    return prediction
