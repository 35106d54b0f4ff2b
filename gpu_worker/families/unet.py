"""The Stable Diffusion families (sd15, sdxl, tiny): text encoders, a UNet and a
noise scheduler, in ``gpu_worker.denoising.diffusers_denoiser``'s loop. The same loaded model
makes images from text, edits an input image and inpaints it: an edit differs only
in where its loop starts and what it keeps (``DiffusersDenoiser.start``)."""

from __future__ import annotations

from typing import Any

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from services.models import speed
from services.models.spec import ModelFamily, ModelSpec
from services.models.speed import SpeedOptions

# SD 1.5's pipelines would load a safety checker too; the sampler has no use for one.
_NO_SAFETY_CHECKER = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}


class UNetDenoiser(DiffusersDenoiser):
    network_name = "unet"

    def pipeline_parts(self, spec: ModelSpec) -> dict[str, Any]:
        parts = super().pipeline_parts(spec)
        if spec.family in (ModelFamily.SD15, ModelFamily.TINY):
            parts.update(_NO_SAFETY_CHECKER)
        return parts

    def prepare_network(self, pipe: Any, spec: ModelSpec, options: SpeedOptions) -> None:
        pipe.unet = speed.prepare_unet(pipe.unet, options)
