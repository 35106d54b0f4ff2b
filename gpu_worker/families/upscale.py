"""Stable Diffusion's x4 upscaler (``StableDiffusionUpscalePipeline``): a UNet over
latents the input image's size, the input (noised to a fixed level) concatenated
to them at every step and the level given as a class label, in
``gpu_worker.denoising.diffusers_denoiser``'s loop; its VAE (in the decoder service) makes
the output four times the input's size."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.denoising.checkpoint_capture import LoopState
from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.members import BatchMember, MemberInputs, no_input_image
from gpu_worker.denoising.prompts import Conditioning
from services.generation import GenerationParams
from services.models.device import module_dtype
from services.models.spec import ModelSpec

# The output's size over the input's (and its latents').
SCALE = 4
# The noise added to the input before it conditions the UNet (the pipeline's
# default), out of its max_noise_level of 350: more hides more of the input's flaws
# and of its detail.
NOISE_LEVEL = 20
# The input, noised: what every step concatenates to the latents (and a resumed
# member reads from its checkpoint).
NOISED_IMAGE = "noised_image"


class UpscaleDenoiser(DiffusersDenoiser):
    network_name = "unet"

    def pipeline_parts(self, spec: ModelSpec) -> dict[str, Any]:
        return {"vae": None, "safety_checker": None, "feature_extractor": None, "watermarker": None}

    def latent_shape(self, pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        # The latents are the input's size (the pipeline's own vae_scale_factor
        # assumes 8 without its VAE, which the sampler does not load).
        channels = pipe.unet.config.out_channels
        return (params.num_images, channels, params.height // SCALE, params.width // SCALE)

    def start(self, pipe: Any, run: DiffusersRun, member: BatchMember) -> None:
        """The input noised to NOISE_LEVEL by the pipeline's low-resolution
        scheduler, then the latents' noise: both drawn from each output's
        generator, in the pipeline's order."""
        state = _state(run)
        if member.inputs is None or member.inputs.image is None:
            raise no_input_image(member.params.model)
        image = member.inputs.image.to(self.device, module_dtype(self.network(pipe)))
        level = torch.tensor([NOISE_LEVEL], device=self.device)
        noised = []
        for g in state.generators:
            eps = torch.randn(image.shape, generator=g, device=self.device, dtype=image.dtype)
            noised.append(pipe.low_res_scheduler.add_noise(image, eps, level))
        state.extras = {NOISED_IMAGE: torch.cat(noised)}
        state.latents = self.draw_noise(pipe, member.params, state) * state.scheduler.init_noise_sigma

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        """A grey input a quarter of the output's size."""
        return MemberInputs(image=torch.zeros(1, 3, params.height // SCALE, params.width // SCALE))

    def model_input(self, run: DiffusersRun, latents: torch.Tensor) -> torch.Tensor:
        return torch.cat([latents, _state(run).extras[NOISED_IMAGE]], dim=1)

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        labels = torch.full((x.shape[0],), NOISE_LEVEL, dtype=torch.long, device=self.device)
        return pipe.unet(x, t, encoder_hidden_states=c.embeds, class_labels=labels, return_dict=False)[0]


def _state(run: DiffusersRun) -> LoopState:
    assert run.state is not None
    return run.state
