"""Stable Diffusion 3 and 3.5 (``StableDiffusion3Pipeline``): two CLIP text encoders
and a T5, an MMDiT over 16-channel latents in 2x2 patches, and a flow-matching Euler
noise scheduler, in ``gpu_worker.denoising.diffusers_denoiser``'s loop, with classifier-free
guidance as SD 1.5's (its rows doubled, the negative prompt's first)."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.noise_schedulers import size_shift
from gpu_worker.denoising.prompts import Conditioning
from services.generation import GenerationParams


class SD3Denoiser(DiffusersDenoiser):
    network_name = "transformer"

    def timestep_args(self, pipe: Any, params: GenerationParams) -> dict[str, Any]:
        config = pipe.scheduler.config
        if not config.get("use_dynamic_shifting"):
            return {}  # SD 3.5: a fixed shift, in the scheduler's config
        patch = pipe.transformer.config.patch_size
        scale = pipe.vae_scale_factor
        tokens = (params.height // scale // patch) * (params.width // scale // patch)
        return {"mu": size_shift(config, tokens, max_shift=1.16)}

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        return pipe.transformer(
            hidden_states=x,
            timestep=t.expand(x.shape[0]),
            encoder_hidden_states=c.embeds,
            pooled_projections=c.pooled,
            return_dict=False,
        )[0]
