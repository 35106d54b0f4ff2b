"""Qwen-Image (``QwenImagePipeline``): a Qwen2.5-VL's last hidden states as the
prompt's embeddings (of a length that varies with the prompt), a dual-stream MMDiT
over latents packed in 2x2 patches, (N, H/16 * W/16, 64), and a flow-matching Euler
noise scheduler shifted by the image's size, in
``gpu_worker.denoising.diffusers_denoiser``'s loop.

Its guidance is true classifier-free guidance: a guided step predicts with the
prompt and with the negative prompt (a space where a job gives none, as Qwen-Image's
own examples do), and their combination is scaled back to the norm of the prompt's
prediction, token by token. The two texts differ in length: on a CPU each half is a
network call of its own, as the pipeline makes them, the only way a job's latents
are exactly the pipeline's; on an accelerator the halves and the members share one
call, each text padded to the longest and masked. A compiled network takes every
text padded to the longest prompt, so that no prompt's length compiles it again.

A member's latents stay packed through its steps and checkpoints, and leave as the
decoder's VAE takes them, (N, 16, H/8, W/8): its frame axis is the decoder's to add."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.prompts import Conditioning, text_length
from services.generation import GenerationParams
from services.models import speed
from services.models.spec import ModelSpec

# The longest prompt, in tokens: QwenImagePipeline's default max_sequence_length.
TEXT_LEN = 512
# The negative prompt of a job that gives none: Qwen-Image's examples' (the pipeline
# guides only with one, and the empty string is a prompt like any other).
NO_NEGATIVE_PROMPT = " "


class QwenImageDenoiser(DiffusersDenoiser):
    network_name = "transformer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where members share calls, a guided step's halves share one too, masked.
        self.halves_share_call = self.fuse_batches
        self._compiled: weakref.WeakSet[Any] = weakref.WeakSet()  # networks that take fixed-length text

    def latent_shape(self, pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        h, w = self._grid(pipe, params)
        return (params.num_images, h * w, pipe.transformer.config.in_channels)

    def encode_prompt(self, pipe: Any, spec: ModelSpec, params: GenerationParams, cfg: bool) -> Conditioning:
        """Each text alone, as the pipeline encodes it: a prompt alone has no padding,
        so its mask (every position a token) is left out."""
        longest = text_length(pipe.tokenizer, TEXT_LEN)
        embeds, _ = pipe.encode_prompt(params.prompt, self.device, 1, max_sequence_length=longest)
        if not cfg:
            return Conditioning(embeds=embeds)
        negative_prompt = params.negative_prompt or NO_NEGATIVE_PROMPT
        negative, _ = pipe.encode_prompt(negative_prompt, self.device, 1, max_sequence_length=longest)
        return Conditioning(embeds=embeds, negative_embeds=negative)

    def timestep_args(self, pipe: Any, params: GenerationParams) -> dict[str, Any]:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        config = pipe.scheduler.config
        h, w = self._grid(pipe, params)
        mu = calculate_shift(
            h * w,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": np.linspace(1.0, 1 / params.steps, params.steps), "mu": mu}

    def draw_noise(self, pipe: Any, params: GenerationParams, state: Any) -> torch.Tensor:
        """Drawn as the VAE's (1, 1, C, H/8, W/8), one draw per output, then packed: as
        ``QwenImagePipeline`` does."""
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self._grid(pipe, params)
        channels = pipe.transformer.config.in_channels // 4
        shape = (1, 1, channels, h * 2, w * 2)
        dtype = pipe.transformer.dtype
        noise = torch.cat([randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in state.generators])
        return pipe._pack_latents(noise, params.num_images, channels, h * 2, w * 2)

    def output_latents(self, pipe: Any, params: GenerationParams, latents: torch.Tensor) -> torch.Tensor:
        return pipe._unpack_latents(latents, params.height, params.width, pipe.vae_scale_factor)[:, :, 0]

    def combine_guidance(
        self, pipe: Any, uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """Classifier-free guidance rescaled, token by token, to the norm of the
        prompt's prediction (``QwenImagePipeline``'s), so guidance steers and never
        inflates the velocity."""
        combined = uncond + scale * (cond - uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def prepare_network(self, pipe: Any, spec: ModelSpec, options: speed.SpeedOptions) -> None:
        super().prepare_network(pipe, spec, options)
        if options.compile:
            self._compiled.add(self.network(pipe))

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        rows = x.shape[0]
        network = pipe.transformer
        if network in self._compiled:
            c = c.text_padded(text_length(pipe.tokenizer, TEXT_LEN))
        h, w = self._grid(pipe, runs[0].member.params)
        return network(
            hidden_states=x,
            timestep=t.expand(rows).to(x.dtype) / 1000,
            encoder_hidden_states=c.embeds,
            encoder_hidden_states_mask=c.mask,
            img_shapes=[[(1, h, w)]] * rows,
            return_dict=False,
        )[0]

    def _grid(self, pipe: Any, params: GenerationParams) -> tuple[int, int]:
        """The packed latents' height and width: a 2x2 patch of the VAE's latents each."""
        scale = pipe.vae_scale_factor * 2
        return params.height // scale, params.width // scale
