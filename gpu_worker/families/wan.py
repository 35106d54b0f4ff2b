"""Wan 2.1 text to video (``WanPipeline``): a UMT5 text encoder, a 3D transformer
over latents of (16, latent frames, H/8, W/8), and a flow-matching UniPC noise
scheduler, in ``gpu_worker.denoising.diffusers_denoiser``'s loop: a video job is denoised,
checkpointed, suspended and resumed like an image job, its latents one dimension
deeper."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.prompts import Conditioning
from services.generation import GenerationParams
from services.models.device import module_dtype
from services.models.spec import ModelSpec


class WanDenoiser(DiffusersDenoiser):
    network_name = "transformer"

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
        timestep = t.expand(x.shape[0])
        return pipe.transformer(
            hidden_states=x.to(module_dtype(pipe.transformer)),
            timestep=timestep,
            encoder_hidden_states=c.embeds,
            return_dict=False,
        )[0]
