"""The flow-matching presets (SD 3.5 Medium, Flux.1, Qwen-Image, Z-Image-Turbo) have
the real architectures (the published parameter counts), and the code that builds
them at full size builds a directory the family's pipeline and the sampler both
load: checked with the same builder at a miniature's sizes, in float32, on the CPU
(Qwen-Image's with its miniature's)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    FluxPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    ZImagePipeline,
)

from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.flow_presets import (
    FLOW_PRESETS,
    FLUX1_DEV,
    QWEN_IMAGE,
    SD35_MEDIUM,
    FlowPreset,
    build_flow_preset,
    flow_parameter_counts,
)
from services.models.qwen_tiny import TINY_TEXT, TINY_TRANSFORMER, TINY_VAE, TINY_VISION
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily, ModelSpec
from services.models.z_image import (
    FLUX_VAE,
    QWEN3_4B,
    Z_IMAGE_TRANSFORMER,
    build_z_image_turbo_preset,
    z_image_parameter_counts,
)

T5_XXL = 4_762_310_656  # google/t5-v1_1-xxl's encoder
CLIP_L = 123_060_480
VAE = 83_819_683
REAL = {
    # SD 3.5 Medium's MMDiT-X saves 4.94 GB in bf16: these 2.24B parameters and its
    # 384x384 position table (a buffer of 0.23B).
    "sd35-medium": {
        "text_encoder": CLIP_L + 768 * 768,  # with its projection
        "text_encoder_2": 694_659_840,
        "text_encoder_3": T5_XXL,
        "transformer": 2_243_171_520,
        "vae": VAE,
    },
    "flux1-dev": {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL, "transformer": 11_901_408_320, "vae": VAE},
    # schnell has no guidance embedding.
    "flux1-schnell": {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL, "transformer": 11_891_178_560, "vae": VAE},
    # Qwen-Image's 20.4B MMDiT; Qwen2.5-VL-7B-Instruct's 8.29B (its vision tower and
    # untied output head included); Wan 2.1's VAE.
    "qwen-image": {"text_encoder": 8_292_166_656, "transformer": 20_430_401_088, "vae": 126_892_531},
}
# Z-Image-Turbo: its S3-DiT 6.15B, Qwen3-4B (no LM head) 4.02B, Flux.1's VAE.
Z_IMAGE_TURBO = {"text_encoder": 4_022_468_096, "transformer": 6_154_908_736, "vae": VAE}
SMALL_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
SMALL_T5 = dict(vocab_size=300, d_model=64, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
SMALL_VAE = dict(block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=128)
SMALL = {
    "sd35-medium": replace(
        SD35_MEDIUM,
        transformer={
            **SD35_MEDIUM.transformer,
            **dict(num_layers=2, attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64),
            **dict(caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=64),
            "dual_attention_layers": (0,),
        },
        clips=(SMALL_CLIP, SMALL_CLIP),
        t5=SMALL_T5,
    ),
    "flux1-dev": replace(
        FLUX1_DEV,
        transformer={
            **FLUX1_DEV.transformer,
            **dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2),
            **dict(joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
        },
        clips=(SMALL_CLIP,),
        t5={**SMALL_T5, "d_model": 32},
    ),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_preset_has_the_real_parameter_counts(name: str) -> None:
    assert flow_parameter_counts(FLOW_PRESETS[name]) == REAL[name]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_preset_builder_makes_a_directory_the_pipeline_and_the_sampler_load(tmp_path: Path, name: str) -> None:
    preset: FlowPreset = replace(SMALL[name], vae={**SMALL[name].vae, **SMALL_VAE}, text_len=32)
    path = build_flow_preset(preset, tmp_path / name, dtype=torch.float32)
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    assert type(pipe) is (StableDiffusion3Pipeline if name.startswith("sd35") else FluxPipeline)
    family = ModelFamily.SD3 if name.startswith("sd35") else ModelFamily.FLUX
    spec = ModelSpec(name, str(path), family, dtype="float32", size_step=16, default_guidance=3.5)
    engine = SamplerEngine(ModelRegistry({name: spec}), tmp_path, torch.device("cpu"))
    params = GenerationParams(name, "a lighthouse", "", 64, 64, 2, 3.5, 1, 1)
    latents = engine.sample(params, lambda step, total: None, threading.Event())
    assert latents.shape == (1, 16, 8, 8) and bool(torch.isfinite(latents).all())


def test_the_qwen_image_preset_builder_makes_a_directory_the_pipeline_and_the_sampler_load(tmp_path: Path) -> None:
    text = {**TINY_TEXT, "vocab_size": 300}  # the preset's table: more rows than the tokenizer's
    small = replace(QWEN_IMAGE, transformer=TINY_TRANSFORMER, text=text, vision=TINY_VISION, vae=TINY_VAE)
    path = build_flow_preset(small, tmp_path / "qwen-image", dtype=torch.float32)
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    assert type(pipe) is QwenImagePipeline
    spec = ModelSpec("qwen-image", str(path), ModelFamily.QWEN_IMAGE, dtype="float32", size_step=16)
    engine = SamplerEngine(ModelRegistry({"qwen-image": spec}), tmp_path, torch.device("cpu"))
    params = GenerationParams("qwen-image", "a lighthouse", "", 64, 64, 2, 4.0, 1, 1)
    latents = engine.sample(params, lambda step, total: None, threading.Event())
    assert latents.shape == (1, 16, 8, 8) and bool(torch.isfinite(latents).all())


def test_z_image_turbo_has_the_real_parameter_counts() -> None:
    assert z_image_parameter_counts() == Z_IMAGE_TURBO


def test_the_z_image_builder_makes_a_directory_the_pipeline_and_the_sampler_load(tmp_path: Path) -> None:
    small = dict(dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6])
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8)
    path = build_z_image_turbo_preset(
        tmp_path / "z-image",
        dtype=torch.float32,
        transformer={**Z_IMAGE_TRANSFORMER, **small},
        text_encoder={**QWEN3_4B, **text, "num_key_value_heads": 2, "vocab_size": 300},
        vae={**FLUX_VAE, **SMALL_VAE},
    )
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    assert type(pipe) is ZImagePipeline
    spec = ModelSpec("z-image", str(path), ModelFamily.Z_IMAGE, dtype="float32", size_step=16, default_guidance=0.0)
    engine = SamplerEngine(ModelRegistry({"z-image": spec}), tmp_path, torch.device("cpu"))
    for guidance in (0.0, 4.0):
        params = GenerationParams("z-image", "a lighthouse", "", 64, 64, 2, guidance, 1, 1)
        latents = engine.sample(params, lambda step, total: None, threading.Event())
        assert latents.shape == (1, 16, 8, 8) and bool(torch.isfinite(latents).all())
