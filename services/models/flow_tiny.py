"""Miniatures of the flow-matching transformers, built from config with random
weights and saved as diffusers directories: Stable Diffusion 3.5 (an MMDiT over
two CLIPs and a T5) and Flux.1 dev, schnell and Kontext (a double- and single-stream
transformer over packed 2x2 latents, a CLIP and a T5). Tests and the demo run
them on a CPU in a fraction of a second; their output is noise, by design.

What each keeps of the real model: its pipeline class and components, 16 latent
channels, a four-level VAE (8x) with the real scaling and shift factors, the
transformer's patching (so sizes are multiples of 16), the real noise-scheduler
configuration (SD 3.5's shift 3.0; Flux.1 dev's resolution-dependent shift, schnell's
none), and, for dev, the guidance embedding that makes the guidance scale an input.
The T5 prompt is 64 tokens long rather than 256 or 512: that is most of their cost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.models.presets import clip_tokenizer
from services.models.wan import t5_tokenizer

SD3_TINY_MARKER = "darkroom_tiny_sd3.json"
FLUX_TINY_MARKER = "darkroom_tiny_flux.json"
TINY_TEXT_LEN = 64

# The real models' VAE factors (stabilityai/stable-diffusion-3.5-medium and
# black-forest-labs/FLUX.1-dev vae/config.json): latents are (z - shift) * scale.
SD3_VAE_FACTORS = {"scaling_factor": 1.5305, "shift_factor": 0.0609}
FLUX_VAE_FACTORS = {"scaling_factor": 0.3611, "shift_factor": 0.1159}
# Their scheduler/scheduler_config.json.
SD3_SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}
FLUX_DEV_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
}
FLUX_SCHNELL_SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}


def build_tiny_sd3(path: Path, *, seed: int = 0) -> Path:
    """An SD 3.5 Medium-shaped MMDiT (with its dual-attention block and QK norms)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    tokenizer, text_encoder = _clip(projection=True)
    tokenizer_2, text_encoder_2 = _clip(projection=True)
    # The MMDiT's context is the CLIPs' states side by side, padded to T5's width.
    tokenizer_3, text_encoder_3 = _t5(width=64)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,  # the two CLIPs' projections
        pos_embed_max_size=64,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
        vae=_vae(SD3_VAE_FACTORS),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    return _save(pipe, Path(path), SD3_TINY_MARKER, seed)


def build_tiny_flux_dev(path: Path, *, seed: int = 0) -> Path:
    """A Flux.1 dev-shaped transformer: guidance-distilled, the scale an input."""
    return _build_flux(Path(path), seed, guidance=True, scheduler=FLUX_DEV_SCHEDULER)


def build_tiny_flux_schnell(path: Path, *, seed: int = 0) -> Path:
    """A Flux.1 schnell-shaped transformer: timestep-distilled, no guidance at all."""
    return _build_flux(Path(path), seed, guidance=False, scheduler=FLUX_SCHNELL_SCHEDULER)


def build_tiny_flux_kontext(path: Path, *, seed: int = 0) -> Path:
    """A Flux.1 Kontext-shaped model: dev's transformer, which takes the input image's
    packed latents as more tokens beside the ones it denoises."""
    return _build_flux(Path(path), seed, guidance=True, scheduler=FLUX_DEV_SCHEDULER, kontext=True)


def _build_flux(path: Path, seed: int, *, guidance: bool, scheduler: dict[str, Any], kontext: bool = False) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    tokenizer, text_encoder = _clip(projection=False)  # its pooled output only
    tokenizer_2, text_encoder_2 = _t5(width=32)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 channels in 2x2 patches
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance,
        axes_dims_rope=(4, 6, 6),  # sums to the head's width
    )
    pipe = (FluxKontextPipeline if kontext else FluxPipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
        vae=_vae(FLUX_VAE_FACTORS),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    return _save(pipe, path, FLUX_TINY_MARKER, seed)


def _save(pipe: Any, path: Path, marker: str, seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path)
    (path / marker).write_text(json.dumps({"seed": seed, "note": "random weights: output is noise"}))
    return path


def _clip(*, projection: bool) -> tuple[Any, Any]:
    """A byte-level CLIP tokenizer and a two-layer, 32-wide CLIP text encoder (with
    SD 3's text projection, or Flux's pooled output)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = clip_tokenizer()
    vocab = tokenizer.get_vocab()
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    return tokenizer, (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(*, width: int) -> tuple[Any, Any]:
    """A character-level T5 tokenizer and a two-layer T5 encoder ``width`` wide."""
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer(TINY_TEXT_LEN)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=width,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
    )
    return tokenizer, T5EncoderModel(config)


def _vae(factors: dict[str, float]) -> Any:
    """SD 3's and Flux's VAE in miniature: 16 latent channels, 8x, no quant convs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(16, 16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=128,
        use_quant_conv=False,
        use_post_quant_conv=False,
        **factors,
    )
