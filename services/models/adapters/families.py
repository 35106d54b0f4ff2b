"""Which families take adapters, and how each reads one: its pipeline class (whose
LoRA loader reads the files) and its denoising network's folder. Apart from the
readers, which import torch: a gateway names a base model's network with these
and imports none of it."""

from __future__ import annotations

from collections.abc import Mapping

from services.models.spec import ModelFamily

# Each family adapters apply to: its pipeline class (whose LoRA loader reads the
# files) and its denoising network's prefix in a diffusers LoRA state dict.
LORA_LOADERS: Mapping[ModelFamily, tuple[str, str]] = {
    ModelFamily.TINY: ("StableDiffusionPipeline", "unet"),
    ModelFamily.SD15: ("StableDiffusionPipeline", "unet"),
    ModelFamily.SDXL: ("StableDiffusionXLPipeline", "unet"),
    ModelFamily.SD3: ("StableDiffusion3Pipeline", "transformer"),
    ModelFamily.FLUX: ("FluxPipeline", "transformer"),
    ModelFamily.FLUX_KONTEXT: ("FluxKontextPipeline", "transformer"),
    ModelFamily.QWEN_IMAGE: ("QwenImagePipeline", "transformer"),
    ModelFamily.QWEN_IMAGE_EDIT: ("QwenImageEditPipeline", "transformer"),
    ModelFamily.Z_IMAGE: ("ZImagePipeline", "transformer"),
}
