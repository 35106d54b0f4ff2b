"""The Stable Diffusion x4 upscaler (``StableDiffusionUpscalePipeline``) built from config with
random weights, with no model hub: a tiny one for tests and a full-size copy of
stabilityai/stable-diffusion-x4-upscaler for benchmarks and capacity planning. Their output is
noise, by design.

What sets it apart from SD 1.5: the UNet takes 7 channels (4 latent + the 3 RGB channels of the
noised low-resolution image) and that image's noise level as a class label; the latents have the
low-resolution image's height and width, and a 3-level VAE decodes them to 4x the size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.models.presets import PRESET_MARKER, _clip_config, _diffusers_version, clip_tokenizer, save_module
from services.models.spec import ModelFamily

UPSCALER_TINY_MARKER = "darkroom_tiny_upscaler.json"
MAX_NOISE_LEVEL = 350

# The real model's configs: huggingface.co/stabilityai/stable-diffusion-x4-upscaler (unet/, vae/,
# text_encoder/config.json, model_index.json, scheduler/ and low_res_scheduler/scheduler_config.json),
# converted from Stability-AI/stablediffusion configs/stable-diffusion/x4-upscaling.yaml. Keys the
# hub files leave at diffusers' and transformers' defaults are omitted.
UPSCALER_TEXT = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=23, num_attention_heads=16, hidden_act="gelu",
    projection_dim=512,
)  # fmt: skip  # OpenCLIP ViT-H/14 less its last layer: SD 2 conditions on the penultimate one
UPSCALER_UNET = dict(
    sample_size=128,
    in_channels=7,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(256, 512, 512, 1024),
    layers_per_block=2,
    cross_attention_dim=1024,
    attention_head_dim=8,
    use_linear_projection=True,
    # The yaml's disable_self_attentions: the first three levels attend to the text only.
    only_cross_attention=(True, True, True, False),
    # The low-resolution image's noise level (0..max_noise_level) goes in as a class label.
    num_class_embeds=1000,
)
UPSCALER_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(128, 256, 512),
    layers_per_block=2,
    latent_channels=4,
    sample_size=256,
    scaling_factor=0.08333,
)
# The hub's file also has skip_prk_steps=True, a PNDM key that DDIMScheduler does not take.
UPSCALER_SCHEDULER = dict(
    beta_start=0.0001, beta_end=0.02, beta_schedule="scaled_linear", num_train_timesteps=1000, clip_sample=False,
    prediction_type="v_prediction", set_alpha_to_one=False, steps_offset=1,
)  # fmt: skip
# Noises the low-resolution image in pixel space (diffusers' single_file_utils quotes the same).
UPSCALER_LOW_RES_SCHEDULER = dict(
    beta_start=0.0001, beta_end=0.02, beta_schedule="scaled_linear", num_train_timesteps=1000, clip_sample=True,
    prediction_type="epsilon", variance_type="fixed_small",
)  # fmt: skip
# Three levels where the real UNet has four, so that it keeps both a text-only level and a
# self-attention one; three VAE blocks, as in the real one, give the 4x upsampling.
TINY_UNET = dict(
    sample_size=32,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 32, 64),
    layers_per_block=1,
    only_cross_attention=(True, True, False),
    norm_num_groups=8,
)
TINY_VAE = dict(block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=128)


def _schedulers() -> tuple[Any, Any]:
    from diffusers import DDIMScheduler, DDPMScheduler

    return DDIMScheduler(**UPSCALER_SCHEDULER), DDPMScheduler(**UPSCALER_LOW_RES_SCHEDULER)


def build_tiny_upscaler(path: Path, *, seed: int = 0) -> Path:
    """Builds a tiny x4 upscaler with random weights and saves it as a diffusers directory at ``path``."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionUpscalePipeline, UNet2DConditionModel

    from services.models.tiny import _text_parts

    torch.manual_seed(seed)
    path = Path(path)
    tokenizer, text_encoder = _text_parts()  # tiny.py's: byte-level tokenizer, two-layer 32-wide CLIP
    unet = UNet2DConditionModel(
        **{**UPSCALER_UNET, **TINY_UNET, "cross_attention_dim": text_encoder.config.hidden_size}
    )
    vae = AutoencoderKL(**{**UPSCALER_VAE, **TINY_VAE})
    scheduler, low_res_scheduler = _schedulers()
    pipe = StableDiffusionUpscalePipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        low_res_scheduler=low_res_scheduler,
        scheduler=scheduler,
        max_noise_level=MAX_NOISE_LEVEL,
    )
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path)  # type: ignore[attr-defined]
    (path / UPSCALER_TINY_MARKER).write_text(json.dumps({"seed": seed, "note": "random weights: output is noise"}))
    return path


def build_upscaler_preset(path: Path, *, seed: int = 0) -> Path:
    """Builds the full-size x4 upscaler with random weights and saves it as a float16 diffusers
    directory at ``path``, one component at a time (the three networks are 3.5 GB in float32)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = clip_tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    save_module(path / "text_encoder", CLIPTextModel(_clip_config(tokenizer, **UPSCALER_TEXT)), torch.float16)
    save_module(path / "unet", UNet2DConditionModel(**UPSCALER_UNET), torch.float16)
    save_module(path / "vae", AutoencoderKL(**UPSCALER_VAE), torch.float16)
    scheduler, low_res_scheduler = _schedulers()
    scheduler.save_pretrained(path / "scheduler")
    low_res_scheduler.save_pretrained(path / "low_res_scheduler")
    # The hub's model_index.json: no safety checker, feature extractor or watermarker entries.
    index = {
        "_class_name": "StableDiffusionUpscalePipeline",
        "_diffusers_version": _diffusers_version(),
        "max_noise_level": MAX_NOISE_LEVEL,
        "low_res_scheduler": ["diffusers", "DDPMScheduler"],
        "scheduler": ["diffusers", "DDIMScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    (path / PRESET_MARKER).write_text(
        json.dumps({"preset": ModelFamily.SD_X4_UPSCALER, "seed": seed, "note": "random weights"})
    )
    return path


def upscaler_parameter_counts() -> dict[str, int]:
    """Parameters of each network of the full-size upscaler, built on the meta device (no memory)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    tokenizer = clip_tokenizer()
    with torch.device("meta"):
        networks: dict[str, Any] = {
            "unet": UNet2DConditionModel(**UPSCALER_UNET),
            "text_encoder": CLIPTextModel(_clip_config(tokenizer, **UPSCALER_TEXT)),
            "vae": AutoencoderKL(**UPSCALER_VAE),
        }
    return {name: sum(p.numel() for p in net.parameters()) for name, net in networks.items()}
