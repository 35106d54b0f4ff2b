"""Flux.1 Kontext (``FluxKontextPipeline``): instruction edits. Flux.1 dev's loop
(``gpu_worker.families.flux``) with the input image's packed latents as more tokens
beside the ones it denoises, at position ids whose first coordinate is 1, and the
network's output for them dropped. Every job edits an input image (the gateway
refuses one without) and starts from noise: there is no strength, and no mask. The
image's packed latents are the member's extras, so its checkpoints carry them and a
resumed job edits the same image."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.members import BatchMember, MemberInputs
from gpu_worker.denoising.noise_schedulers import IMAGE_LATENTS
from gpu_worker.denoising.prompts import Conditioning
from gpu_worker.families.flux import FluxDenoiser
from services.generation import GenerationParams
from services.models.spec import ModelSpec


class FluxKontextDenoiser(FluxDenoiser):
    def start(self, pipe: Any, run: DiffusersRun, member: BatchMember) -> None:
        state = run.state
        assert state is not None
        inputs = member.inputs
        if inputs is None or inputs.image_latents is None:
            raise ValueError(f"{member.params.model} edits an input image, and this job has none")
        params = member.params
        state.latents = self.draw_noise(pipe, params, state)
        image = inputs.image_latents.to(self.device, state.latents.dtype).repeat(params.num_images, 1, 1, 1)
        _, channels, height, width = image.shape
        state.extras = {IMAGE_LATENTS: pipe._pack_latents(image, params.num_images, channels, height, width)}

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
