"""Z-Image (``ZImagePipeline``) built locally: a miniature with random weights for
tests and the demo, and Z-Image-Turbo's real architecture with random weights for
benchmarks. Z-Image is a single-stream DiT (6.15B parameters) over Flux.1's VAE
latents in 2x2 patches (sizes are multiples of 16), conditioned on the second-last
hidden states of a Qwen3-4B chat model, one row per prompt token, as many as the
prompt has.

The tokenizer stands in for Qwen's (a download): byte-level BPE with no merges,
one token per byte, with the special tokens Qwen's chat template writes, and a
chat template that renders a user's prompt exactly as Qwen3's does. The full-size
preset keeps Qwen's vocabulary size, so its embedding table is the real one's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.models.flow_tiny import FLUX_VAE_FACTORS, _save, _vae
from services.models.presets import PRESET_MARKER, _diffusers_version, save_network

Z_IMAGE_TINY_MARKER = "darkroom_tiny_z_image.json"
# The miniature's longest prompt, in tokens (bytes), chat template included: the
# pipeline's is 512, and its text encoder pads every prompt to it.
TINY_Z_IMAGE_TEXT_LEN = 128
# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a fixed shift.
Z_IMAGE_TURBO_SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}
# Tongyi-MAI/Z-Image-Turbo transformer/config.json.
Z_IMAGE_TRANSFORMER: dict[str, Any] = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30,
    n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
    axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
)  # fmt: skip
QWEN_VOCAB = 151_936
# Qwen/Qwen3-4B's config.json, as Z-Image's text_encoder (a Qwen3Model: no LM head).
QWEN3_4B: dict[str, Any] = dict(
    vocab_size=QWEN_VOCAB, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)  # fmt: skip
# Flux.1's VAE: what Z-Image decodes with.
FLUX_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, sample_size=1024,
    use_quant_conv=False, use_post_quant_conv=False, **FLUX_VAE_FACTORS,
)  # fmt: skip
# Qwen3's chat template, for what ZImagePipeline renders: one user message, the
# assistant's turn opened, thinking enabled (no empty think block).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen_tokenizer(model_max_length: int) -> Any:
    """A byte-level Qwen2 tokenizer (no download): every byte a token, and Qwen's
    special tokens; prompts are padded (right) with ``<|endoftext|>`` as Qwen's are."""
    from transformers import AddedToken, Qwen2Tokenizer

    from services.models.tiny import _bytes_to_unicode

    chars = list(_bytes_to_unicode().values())
    vocab = {token: i for i, token in enumerate([*chars, *SPECIAL_TOKENS])}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=model_max_length, chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in SPECIAL_TOKENS[1:]]}
    )
    return tokenizer


def build_tiny_z_image(path: Path, *, seed: int = 0) -> Path:
    """A Z-Image-shaped model: the single-stream DiT with its refiners, QK norms and
    3-axis RoPE, a two-layer Qwen3 text encoder, Flux.1's VAE factors and
    Z-Image-Turbo's noise-scheduler configuration."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer(TINY_Z_IMAGE_TEXT_LEN)
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=TINY_Z_IMAGE_TEXT_LEN,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    transformer = ZImageTransformer2DModel(
        **{
            **Z_IMAGE_TRANSFORMER,
            **dict(dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32),
            "axes_dims": [4, 6, 6],  # sums to the head's width
        }
    )
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_TURBO_SCHEDULER),
        vae=_vae(FLUX_VAE_FACTORS),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return _save(pipe, Path(path), Z_IMAGE_TINY_MARKER, seed)


def build_z_image_turbo_preset(
    path: Path,
    *,
    seed: int = 0,
    dtype: Any = None,
    transformer: dict[str, Any] | None = None,
    text_encoder: dict[str, Any] | None = None,
    vae: dict[str, Any] | None = None,
) -> Path:
    """Z-Image-Turbo's architecture with random weights, saved as a diffusers
    directory at ``path`` (bfloat16 unless ``dtype`` says otherwise), one network at
    a time; the sizes may be overridden (a test builds it small)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    dtype = dtype or torch.bfloat16
    torch.manual_seed(seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    networks = _networks(transformer, text_encoder, vae)
    for name, (_, make) in networks.items():
        save_network(path / name, make, dtype)
    text_len = 512  # ZImagePipeline's longest prompt
    qwen_tokenizer(text_len).save_pretrained(path / "tokenizer")
    scheduler: Any = FlowMatchEulerDiscreteScheduler(**Z_IMAGE_TURBO_SCHEDULER)
    scheduler.save_pretrained(path / "scheduler")
    index: dict[str, Any] = {"_class_name": "ZImagePipeline", "_diffusers_version": _diffusers_version()}
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    for name, (cls, _) in networks.items():
        index[name] = ["transformers" if name == "text_encoder" else "diffusers", cls]
    index["tokenizer"] = ["transformers", "Qwen2Tokenizer"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    (path / PRESET_MARKER).write_text(json.dumps({"preset": "z-image-turbo", "seed": seed, "note": "random weights"}))
    return path


def z_image_parameter_counts() -> dict[str, int]:
    """Parameters of each network of Z-Image-Turbo, built on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        return {name: sum(p.numel() for p in make().parameters()) for name, (_, make) in _networks().items()}


def _networks(
    transformer: dict[str, Any] | None = None,
    text_encoder: dict[str, Any] | None = None,
    vae: dict[str, Any] | None = None,
) -> dict[str, tuple[str, Callable[[], Any]]]:
    """Each network's name in the pipeline: its class's name, and a function that builds it."""
    import diffusers
    import transformers

    return {
        "text_encoder": (
            "Qwen3Model",
            lambda: transformers.Qwen3Model(transformers.Qwen3Config(**(text_encoder or QWEN3_4B))),
        ),
        "transformer": (
            "ZImageTransformer2DModel",
            lambda: diffusers.ZImageTransformer2DModel(**(transformer or Z_IMAGE_TRANSFORMER)),
        ),
        "vae": ("AutoencoderKL", lambda: diffusers.AutoencoderKL(**(vae or FLUX_VAE))),
    }
