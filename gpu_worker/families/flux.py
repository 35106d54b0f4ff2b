"""Flux.1 (``FluxPipeline``): a CLIP (its pooled output) and a T5, a double- and
single-stream transformer over latents packed in 2x2 patches, (N, H/16 * W/16, 64),
and a flow-matching Euler noise scheduler shifted by the image's size, in
``gpu_worker.denoising.diffusers_denoiser``'s loop.

Flux.1 dev is guidance-distilled: the guidance scale is an input of the network,
one per row, so a step never doubles its rows, and members of other guidance share
a call as they are. Schnell has no guidance at all. A member's latents stay packed
through its steps and checkpoints, and are unpacked for its VAE as it leaves.
Flux.1 Kontext (instruction edits) is dev's loop with its input image beside it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.members import BatchMember, MemberInputs, no_input_image
from gpu_worker.denoising.noise_schedulers import IMAGE_LATENTS, size_shift
from gpu_worker.denoising.prompts import Conditioning
from gpu_worker.denoising.step_groups import guidance_column
from services.generation import GenerationParams
from services.models.device import module_dtype
from services.models.spec import ModelSpec

# Sizes whose position ids stay on the device. A batch's size is its jobs' (any
# multiple of the size step within the model's bounds, thousands of them), so
# those of sizes no longer asked for go, least recently used first.
IMAGE_POSITIONS_KEPT = 16


class FluxDenoiser(DiffusersDenoiser):
    network_name = "transformer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Position ids, made once per size on the device: a copy onto it each step
        # would wait for its queue.
        self._image_ids: OrderedDict[tuple[int, int, torch.dtype], torch.Tensor] = OrderedDict()
        self._text_ids: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def classifier_free(self, params: GenerationParams) -> bool:
        return False  # dev's guidance is an input; schnell has none

    def latent_shape(self, pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        h, w = self._grid(pipe, params)
        return (params.num_images, h * w, pipe.transformer.config.in_channels)

    def image_tokens(self, pipe: Any, params: GenerationParams) -> int:
        h, w = self._grid(pipe, params)
        return h * w

    def encode_prompt(self, pipe: Any, spec: ModelSpec, params: GenerationParams, cfg: bool) -> Conditioning:
        """Dev's T5 prompt is longer than schnell's: its network's config says which it is."""
        config = pipe.transformer.config
        return Conditioning.encode(pipe, spec.family, params, self.text_device(pipe), cfg, network_config=config)

    def timestep_args(self, pipe: Any, params: GenerationParams) -> dict[str, Any]:
        h, w = self._grid(pipe, params)
        mu = size_shift(pipe.scheduler.config, h * w)
        return {"sigmas": np.linspace(1.0, 1 / params.steps, params.steps), "mu": mu}

    def draw_noise(self, pipe: Any, params: GenerationParams, state: Any) -> torch.Tensor:
        """Drawn unpacked, one draw per output, then packed: as ``FluxPipeline`` does."""
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self._grid(pipe, params)
        shape = (1, pipe.transformer.config.in_channels // 4, h * 2, w * 2)
        dtype = module_dtype(pipe.transformer)
        noise = torch.cat([randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in state.generators])
        return pipe._pack_latents(noise, params.num_images, shape[1], h * 2, w * 2)

    def in_latent_layout(self, pipe: Any, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
        """Packed as the latents are; a mask first given each latent channel, as FluxInpaintPipeline does."""
        channels = pipe.transformer.config.in_channels // 4
        if x.shape[1] == 1:
            x = x.repeat(1, channels, 1, 1)
        return pipe._pack_latents(x, x.shape[0], channels, x.shape[2], x.shape[3])

    def output_latents(self, pipe: Any, params: GenerationParams, latents: torch.Tensor) -> torch.Tensor:
        return pipe._unpack_latents(latents, params.height, params.width, pipe.vae_scale_factor)

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        rows = x.shape[0]
        network = pipe.transformer
        assert c.embeds is not None
        guidance = None
        if network.config.guidance_embeds:
            sizes = [r.member.params.num_images for r in runs]
            guidance = guidance_column(runs, sizes, rows)
        return network(
            hidden_states=x,
            timestep=t.expand(rows).to(x.dtype) / 1000,
            guidance=guidance,
            pooled_projections=c.pooled,
            encoder_hidden_states=c.embeds,
            txt_ids=self._text_positions(c.embeds),
            img_ids=self._image_positions(pipe, runs[0].member.params, x.dtype),
            return_dict=False,
        )[0]

    def _grid(self, pipe: Any, params: GenerationParams) -> tuple[int, int]:
        """The packed latents' height and width: a 2x2 patch of the VAE's latents each."""
        scale = pipe.vae_scale_factor * 2
        return params.height // scale, params.width // scale

    def _image_positions(self, pipe: Any, params: GenerationParams, dtype: torch.dtype) -> torch.Tensor:
        h, w = self._grid(pipe, params)
        key = (h, w, dtype)
        found = self._image_ids.get(key)
        if found is not None:
            self._image_ids.move_to_end(key)
            return found
        found = self._image_ids[key] = self._new_image_positions(pipe, h, w, dtype)
        if len(self._image_ids) > IMAGE_POSITIONS_KEPT:
            self._image_ids.popitem(last=False)
        return found

    def _new_image_positions(self, pipe: Any, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
        return pipe._prepare_latent_image_ids(1, h, w, self.device, dtype)

    def _text_positions(self, embeds: torch.Tensor) -> torch.Tensor:
        key = (embeds.shape[1], embeds.dtype)
        if key not in self._text_ids:
            self._text_ids[key] = torch.zeros(embeds.shape[1], 3).to(device=self.device, dtype=embeds.dtype)
        return self._text_ids[key]


class FluxKontextDenoiser(FluxDenoiser):
    """Flux.1 Kontext (``FluxKontextPipeline``): instruction edits. Flux.1 dev's loop
    (``gpu_worker.families.flux``) with the input image's packed latents as more tokens
    beside the ones it denoises, at position ids whose first coordinate is 1, and the
    network's output for them dropped. Every job edits an input image (the gateway
    refuses one without) and starts from noise: there is no strength, and no mask. The
    image's packed latents are the member's extras, so its checkpoints carry them and a
    resumed job edits the same image."""

    def start(self, pipe: Any, run: DiffusersRun, member: BatchMember) -> None:
        state = run.state
        assert state is not None
        inputs = member.inputs
        if inputs is None or inputs.image_latents is None:
            raise no_input_image(member.params.model)
        params = member.params
        state.latents = self.draw_noise(pipe, params, state)
        image = inputs.image_latents.to(self.device, state.latents.dtype).repeat(params.num_images, 1, 1, 1)
        state.extras = {IMAGE_LATENTS: self.in_latent_layout(pipe, params, image)}

    def model_input(self, run: DiffusersRun, latents: torch.Tensor) -> torch.Tensor:
        assert run.state is not None
        return torch.cat([latents, run.state.extras[IMAGE_LATENTS]], dim=1)

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        h, w = self._grid(pipe, runs[0].member.params)
        return super().call_network(pipe, x, t, c, runs)[:, : h * w]

    def _new_image_positions(self, pipe: Any, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
        """The latents' positions, then the input image's: the same grid at first coordinate 1."""
        latent = super()._new_image_positions(pipe, h, w, dtype)
        image = latent.clone()
        image[..., 0] = 1
        return torch.cat([latent, image])

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        """A blank input image's latents: Flux's VAE makes 16 channels at an eighth of the size."""
        return MemberInputs(image_latents=torch.zeros(1, 16, params.height // 8, params.width // 8))
