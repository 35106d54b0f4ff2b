"""Random-weight copies of the real flow-matching transformers, built from their
configs with no model hub: Stable Diffusion 3.5 Medium (its MMDiT-X, two CLIPs and
T5-XXL), Flux.1 dev and schnell (a 12B transformer, CLIP-L and T5-XXL) and Qwen-Image
(a 20B MMDiT, Qwen2.5-VL-7B with its vision tower, Wan 2.1's VAE). The same
modules, parameter counts and shapes as the real models, so they cost what the real
ones cost to load and run; their output is noise. For ``bench/gpu.py`` and capacity
planning.

Each network is built in bfloat16 and saved before the next is built: the peak
memory is the largest network's (Qwen-Image's transformer, 40.9 GB; Flux.1's, 23.8 GB),
and the disk they take is the real model's (SD 3.5 Medium 16 GB, Flux.1 dev or schnell
33 GB, Qwen-Image 58 GB). The tokenizers stand in for the real ones (a download):
byte-level CLIP and Qwen2, character-level T5 (``services.models.wan``), with the real
embedding tables' rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.models.flow_tiny import (
    FLUX_DEV_SCHEDULER,
    FLUX_SCHNELL_SCHEDULER,
    FLUX_VAE_FACTORS,
    SD3_SCHEDULER,
    SD3_VAE_FACTORS,
)
from services.models.presets import (
    PRESET_MARKER,
    SD15_TEXT,
    SDXL_TEXT_2,
    _clip_config,
    _diffusers_version,
    clip_tokenizer,
    save_network,
)
from services.models.qwen_tiny import (
    QWEN_SCHEDULER,
    QWEN_TEXT,
    QWEN_TRANSFORMER,
    QWEN_VAE,
    QWEN_VISION,
    qwen_text_encoder,
    qwen_tokenizer,
)
from services.models.wan import t5_tokenizer

T5_VOCAB = 32128
# google/t5-v1_1-xxl's encoder: what SD 3 and Flux.1 take as text_encoder_3 / _2.
T5_XXL: dict[str, Any] = dict(
    vocab_size=T5_VOCAB, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
)  # fmt: skip
CLIP_L = dict(SD15_TEXT)  # 12 layers, 768 wide, a 768 projection
CLIP_G = dict(SDXL_TEXT_2)  # OpenCLIP bigG: 32 layers, 1280 wide
# stabilityai/stable-diffusion-3.5-medium transformer/config.json.
SD35_MEDIUM_TRANSFORMER: dict[str, Any] = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)  # fmt: skip
# black-forest-labs/FLUX.1-dev transformer/config.json (schnell's has no guidance embedding).
FLUX1_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
# Both models' VAE: AutoencoderKL with 16 latent channels and no quant convolutions.
FLOW_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, sample_size=1024,
    use_quant_conv=False, use_post_quant_conv=False,
)  # fmt: skip


@dataclass(frozen=True)
class FlowPreset:
    """One real architecture: its pipeline and each network's configuration."""

    name: str
    pipeline: str  # "StableDiffusion3Pipeline" or "FluxPipeline"
    transformer: dict[str, Any]
    vae_factors: dict[str, float]
    scheduler: dict[str, Any]
    clips: tuple[dict[str, Any], ...]  # SD 3: CLIP-L and CLIP-G with projections; Flux: CLIP-L's pooled output
    t5: dict[str, Any] = field(default_factory=lambda: dict(T5_XXL))
    vae: dict[str, Any] = field(default_factory=lambda: dict(FLOW_VAE))
    text_len: int = 512  # the T5 tokenizer's longest prompt


SD35_MEDIUM = FlowPreset(
    "sd35-medium", "StableDiffusion3Pipeline", SD35_MEDIUM_TRANSFORMER, SD3_VAE_FACTORS, SD3_SCHEDULER, (CLIP_L, CLIP_G)
)
FLUX1_DEV = FlowPreset("flux1-dev", "FluxPipeline", FLUX1_TRANSFORMER, FLUX_VAE_FACTORS, FLUX_DEV_SCHEDULER, (CLIP_L,))
FLUX1_SCHNELL = FlowPreset(
    "flux1-schnell",
    "FluxPipeline",
    {**FLUX1_TRANSFORMER, "guidance_embeds": False},
    FLUX_VAE_FACTORS,
    FLUX_SCHNELL_SCHEDULER,
    (CLIP_L,),
)


@dataclass(frozen=True)
class QwenImagePreset:
    """Qwen-Image's architecture: its transformer's, text encoder's and VAE's configurations."""

    name: str
    transformer: dict[str, Any]
    text: dict[str, Any]  # Qwen2.5-VL's language model
    vision: dict[str, Any]  # and its vision tower
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    pipeline: str = "QwenImagePipeline"


QWEN_IMAGE = QwenImagePreset("qwen-image", QWEN_TRANSFORMER, QWEN_TEXT, QWEN_VISION, QWEN_VAE, QWEN_SCHEDULER)
FLOW_PRESETS: dict[str, FlowPreset | QwenImagePreset] = {
    p.name: p for p in (SD35_MEDIUM, FLUX1_DEV, FLUX1_SCHNELL, QWEN_IMAGE)
}


def build_sd35_medium_preset(path: Path) -> Path:
    return build_flow_preset(SD35_MEDIUM, path)


def build_flux1_dev_preset(path: Path) -> Path:
    return build_flow_preset(FLUX1_DEV, path)


def build_flux1_schnell_preset(path: Path) -> Path:
    return build_flow_preset(FLUX1_SCHNELL, path)


def build_qwen_image_preset(path: Path) -> Path:
    return build_flow_preset(QWEN_IMAGE, path)


def build_flow_preset(preset: FlowPreset | QwenImagePreset, path: Path, *, seed: int = 0, dtype: Any = None) -> Path:
    """Builds ``preset`` with random weights and saves it as a diffusers directory at
    ``path`` (bfloat16 unless ``dtype`` says otherwise), one network at a time."""
    import torch

    dtype = dtype or torch.bfloat16
    torch.manual_seed(seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    networks = _networks(preset)
    for name, (_, make) in networks.items():
        save_network(path / name, make, dtype)
    tokenizers = _tokenizers(preset)
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(path / name)
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler: Any = FlowMatchEulerDiscreteScheduler(**preset.scheduler)
    scheduler.save_pretrained(path / "scheduler")
    index: dict[str, Any] = {"_class_name": preset.pipeline, "_diffusers_version": _diffusers_version()}
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    for name, (cls, _) in networks.items():
        index[name] = ["diffusers" if name in ("transformer", "vae") else "transformers", cls]
    for name, tokenizer in tokenizers.items():
        index[name] = ["transformers", type(tokenizer).__name__]
    if isinstance(preset, FlowPreset):
        index["image_encoder"] = index["feature_extractor"] = [None, None]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    (path / PRESET_MARKER).write_text(json.dumps({"preset": preset.name, "seed": seed, "note": "random weights"}))
    return path


def flow_parameter_counts(preset: FlowPreset | QwenImagePreset) -> dict[str, int]:
    """Parameters of each network of ``preset``, built on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        return {name: sum(p.numel() for p in make().parameters()) for name, (_, make) in _networks(preset).items()}


def _tokenizers(preset: FlowPreset | QwenImagePreset) -> dict[str, Any]:
    """Each tokenizer's name in the pipeline, and the tokenizer."""
    if isinstance(preset, QwenImagePreset):
        return {"tokenizer": qwen_tokenizer()}
    clip = clip_tokenizer()
    t5 = t5_tokenizer(preset.text_len)
    if preset.pipeline == "StableDiffusion3Pipeline":
        return {"tokenizer": clip, "tokenizer_2": clip, "tokenizer_3": t5}
    return {"tokenizer": clip, "tokenizer_2": t5}


def _networks(preset: FlowPreset | QwenImagePreset) -> dict[str, tuple[str, Callable[[], Any]]]:
    """Each network's name in the pipeline: its class's name, and a function that builds it."""
    import diffusers
    import transformers

    if isinstance(preset, QwenImagePreset):
        return {
            "text_encoder": (
                "Qwen2_5_VLForConditionalGeneration",
                lambda: qwen_text_encoder(qwen_tokenizer(), preset.text, preset.vision),
            ),
            "transformer": (
                "QwenImageTransformer2DModel",
                lambda: diffusers.QwenImageTransformer2DModel(**preset.transformer),
            ),
            "vae": ("AutoencoderKLQwenImage", lambda: diffusers.AutoencoderKLQwenImage(**preset.vae)),
        }

    tokenizer = clip_tokenizer()
    sd3 = preset.pipeline == "StableDiffusion3Pipeline"
    clip_class = "CLIPTextModelWithProjection" if sd3 else "CLIPTextModel"

    def clip(sizes: dict[str, Any]) -> Callable[[], Any]:
        return lambda: getattr(transformers, clip_class)(_clip_config(tokenizer, **sizes))

    networks: dict[str, tuple[str, Callable[[], Any]]] = {}
    for i, sizes in enumerate(preset.clips):
        networks["text_encoder" if i == 0 else f"text_encoder_{i + 1}"] = (clip_class, clip(sizes))
    t5 = lambda: transformers.T5EncoderModel(transformers.T5Config(**preset.t5))  # noqa: E731
    networks[f"text_encoder_{len(preset.clips) + 1}"] = ("T5EncoderModel", t5)
    transformer = "SD3Transformer2DModel" if sd3 else "FluxTransformer2DModel"
    networks["transformer"] = (transformer, lambda: getattr(diffusers, transformer)(**preset.transformer))
    networks["vae"] = ("AutoencoderKL", lambda: diffusers.AutoencoderKL(**preset.vae, **preset.vae_factors))
    return networks
