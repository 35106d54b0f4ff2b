"""Z-Image and Z-Image-Turbo (``ZImagePipeline``): a Qwen3 chat model's second-last
hidden states, as many rows as the prompt has tokens, and a single-stream DiT over
Flux.1's VAE latents (N, 16, H/8, W/8) in 2x2 patches, with a flow-matching Euler
noise scheduler, in ``gpu_worker.denoising.diffusers_denoiser``'s loop.

What differs from the other flow-matching families, as the pipeline does it:

- The network takes lists: one latent (C, 1, h, w) and one caption of its own
  length per row. A prompt's conditioning keeps its own length; stacked with
  others its rows are padded, and each row's length (``text_lengths``, on the
  host) cuts its caption out again.
- Its timestep runs the other way, ``(1000 - t) / 1000``, and its output is the
  negated velocity: negated in float32 before the scheduler steps.
- The latents stay in float32 through the steps whatever the network's dtype.
- Guidance is on for any scale above 0 (Turbo is distilled: 0) and combines as
  ``cond + scale * (cond - uncond)`` in float32, its norm capped where the model's
  ``cfg_normalization`` says.
- Its sigmas are ``linspace(1, 1/steps)`` (in float32, as the pipeline makes
  them), shifted by the image's size where the scheduler shifts dynamically."""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import torch

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.noise_schedulers import size_shift
from gpu_worker.denoising.prompts import Conditioning
from services.generation import GenerationParams
from services.models import speed
from services.models.device import module_dtype
from services.models.spec import ModelSpec

# Longer than 32 tokens beyond an empty prompt: padded (to 32s) to another length.
WARM_UP_LONG_PROMPT = "a long warm-up prompt, " * 4


class ZImageDenoiser(DiffusersDenoiser):
    network_name = "transformer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each loaded pipeline's model's cfg_normalization (0: none).
        self._normalization: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def prepare_network(self, pipe: Any, spec: ModelSpec, options: speed.SpeedOptions) -> None:
        self._normalization[pipe] = spec.cfg_normalization
        # The RoPE tables, made now on the device: the network makes them on its first
        # call, on the host, which a compiled graph cannot hold.
        rope = pipe.transformer.rope_embedder
        tables = rope.precompute_freqs_cis(rope.axes_dims, rope.axes_lens, theta=rope.theta)
        rope.freqs_cis = [table.to(self.device) for table in tables]
        network = speed.prepare(pipe.transformer, replace(options, compile=False))
        if options.compile:
            speed.compile_repeated_blocks(network, options)
        pipe.transformer = network

    def warm_up_prompts(self, params: GenerationParams) -> list[str]:
        """Guided, also a prompt longer than the empty negative one: rows of captions
        of other lengths take an attention mask, one of the blocks' two shapes (their
        lengths are symbolic: any other prompt then compiles nothing)."""
        return [params.prompt, WARM_UP_LONG_PROMPT] if self.classifier_free(params) else [params.prompt]

    def classifier_free(self, params: GenerationParams) -> bool:
        return params.guidance_scale > 0.0

    def latent_dtype(self, pipe: Any) -> torch.dtype:
        return torch.float32

    def timestep_args(self, pipe: Any, params: GenerationParams) -> dict[str, Any]:
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        _, _, h, w = self.latent_shape(pipe, params)
        mu = size_shift(pipe.scheduler.config, (h // 2) * (w // 2))
        return {"sigmas": get_default_z_image_sigmas(params.steps), "mu": mu}

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        """The negated network output, in float32, one row per row of ``x``: each row's
        latents a (C, 1, h, w) of their own, its caption cut to its own length (the
        pipeline gives a guided step's prompted rows first, ``step_groups`` the
        unprompted: a row's output does not depend on its place)."""
        network = pipe.transformer
        rows = x.shape[0]
        assert c.embeds is not None and c.text_lengths is not None
        images = list(x.to(module_dtype(network)).unsqueeze(2).unbind(0))
        captions = [c.embeds[i, :n] for i, n in enumerate(c.text_lengths.tolist())]
        timestep = (1000 - t.expand(rows)) / 1000
        out = network(images, timestep, captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def combine_guidance(
        self, pipe: Any, uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        guided = cond + scale * (cond - uncond)
        normalization = self._normalization.get(pipe, 0.0)
        if normalization <= 0.0:
            return guided
        # Each image's norm capped at its prompted prediction's times the factor:
        # chosen on the device (``where``), never read back.
        capped = []
        for g, p in zip(guided, cond, strict=True):
            most = torch.linalg.vector_norm(p) * normalization
            norm = torch.linalg.vector_norm(g)
            capped.append(torch.where(norm > most, g * (most / norm), g))
        return torch.stack(capped)
