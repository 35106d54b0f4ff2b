"""Qwen-Image (``QwenImagePipeline``) built from config with random weights, with no
model hub: the real architecture's configs (for ``services.models.flow_presets``'
full-size preset and its parameter counts) and a miniature that runs on a CPU in a
fraction of a second, for tests and the demo. Its output is noise, by design.

What the miniature keeps of the real model: its pipeline class and components (a
Qwen2.5-VL text encoder, vision tower included, whose last hidden states are the
prompt's embeddings; an MMDiT over latents packed in 2x2 patches; Wan 2.1's VAE,
16 channels, 8x, normalised by its per-channel means and deviations), the real
noise-scheduler configuration (a resolution-dependent exponential shift up to
8192 tokens, ending at 0.02) and the prompt template's special tokens. Its tokenizer
is byte-level BPE with no merges (every byte a token), so the 34 tokens the pipeline
drops from the template's front are part of its system prompt rather than all of it;
the text is what it is for any prompt, and so is the pipeline's output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.models.tiny import _byte_level_vocab

QWEN_TINY_MARKER = "darkroom_tiny_qwen_image.json"
QWEN_EDIT_TINY_MARKER = "darkroom_tiny_qwen_image_edit.json"
# The special tokens of QwenImagePipeline's prompt template (and the tokenizer's padding).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# QwenImageEditPipeline's template also frames the input image, whose patches the
# processor writes as image-pad tokens (and a video's as video-pad ones).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen/Qwen-Image scheduler/scheduler_config.json.
QWEN_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
# Qwen/Qwen-Image transformer/config.json: 60 dual-stream blocks, 3072 wide.
QWEN_TRANSFORMER: dict[str, Any] = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
# Its vae/config.json: Wan 2.1's VAE (AutoencoderKLQwenImage's defaults are its latents_mean/std).
QWEN_VAE: dict[str, Any] = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True],
)  # fmt: skip
# Its text_encoder/config.json: Qwen2.5-VL-7B-Instruct, the vision tower included.
QWEN_TEXT: dict[str, Any] = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0},
)  # fmt: skip
QWEN_VISION: dict[str, Any] = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)  # fmt: skip

# Qwen/Qwen2.5-VL-7B-Instruct preprocessor_config.json: images resized to between
# min_pixels and max_pixels, in 28x28 pixels (a 2x2 merge of 14x14 patches) per token.
QWEN_IMAGE_PROCESSOR: dict[str, Any] = dict(
    size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}, patch_size=14, temporal_patch_size=2,
    merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
)  # fmt: skip

# The miniature: two blocks each, 32 wide; the VAE keeps all four levels (its 8x) at 4 channels.
TINY_TRANSFORMER: dict[str, Any] = dict(
    QWEN_TRANSFORMER, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),  # sums to the head's width
)  # fmt: skip
TINY_VAE: dict[str, Any] = dict(QWEN_VAE, base_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
TINY_TEXT: dict[str, Any] = dict(
    QWEN_TEXT, vocab_size=256 + len(SPECIAL_TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},  # half the head's 16
)  # fmt: skip
TINY_VISION: dict[str, Any] = dict(
    QWEN_VISION, depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
    fullatt_block_indexes=[0],
)  # fmt: skip
# The edit miniature's encoder sees at most 112x112 pixels of its input: 16 image tokens.
TINY_IMAGE_PROCESSOR: dict[str, Any] = dict(
    QWEN_IMAGE_PROCESSOR, size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
)


def build_tiny_qwen_image(path: Path, *, seed: int = 0) -> Path:
    """Builds the miniature with random float32 weights and saves it as a diffusers
    directory at ``path``: the same ``seed``, the same weights."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    pipe: Any = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=AutoencoderKLQwenImage(**TINY_VAE),
        text_encoder=qwen_text_encoder(tokenizer, TINY_TEXT, TINY_VISION),
        tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(**TINY_TRANSFORMER),
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path)
    (path / QWEN_TINY_MARKER).write_text(json.dumps({"seed": seed, "note": "random weights: output is noise"}))
    return path


def build_tiny_qwen_image_edit(path: Path, *, seed: int = 0) -> Path:
    """The edit miniature (``QwenImageEditPipeline``): the same parts, its tokenizer
    also knowing the template's vision tokens, and a ``Qwen2VLProcessor`` that turns
    the input image into the encoder's patches; the same ``seed``, the same weights."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2VLImageProcessorPil

    from services.models.qwen_processor import save_processor

    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer(SPECIAL_TOKENS + VISION_TOKENS)
    text = dict(TINY_TEXT, vocab_size=256 + len(SPECIAL_TOKENS) + len(VISION_TOKENS))
    pipe: Any = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=AutoencoderKLQwenImage(**TINY_VAE),
        text_encoder=qwen_text_encoder(tokenizer, text, TINY_VISION),
        tokenizer=tokenizer,
        processor=None,  # saved below, as a stock Qwen2VLProcessor loads it
        transformer=QwenImageTransformer2DModel(**TINY_TRANSFORMER),
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path)
    save_processor(path / "processor", tokenizer, Qwen2VLImageProcessorPil(**TINY_IMAGE_PROCESSOR))
    index = json.loads((path / "model_index.json").read_text())
    (path / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen2VLProcessor"]}))
    (path / QWEN_EDIT_TINY_MARKER).write_text(json.dumps({"seed": seed, "note": "random weights: output is noise"}))
    return path


def qwen_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Any:
    """A byte-level Qwen2 tokenizer (no download): every byte a token, and the prompt
    template's special tokens (the first of them its padding)."""
    from transformers import Qwen2Tokenizer

    chars = [token for token in _byte_level_vocab() if not token.endswith("</w>") and not token.startswith("<|")]
    vocab = {token: i for i, token in enumerate([*chars, *special_tokens])}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=2048)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens[1:])})
    return tokenizer


def qwen_text_encoder(tokenizer: Any, text: dict[str, Any], vision: dict[str, Any]) -> Any:
    """A Qwen2.5-VL of ``text`` and ``vision``'s sizes, its special tokens the tokenizer's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = tokenizer.get_vocab()
    pad = vocab["<|endoftext|>"]
    # Where the tokenizer knows the vision tokens, the encoder finds the image's patches by their ids.
    vision_ids = {
        name: vocab[token]
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            VISION_TOKENS,
            strict=True,
        )
        if token in vocab
    }
    config = Qwen2_5_VLConfig(
        text_config={**text, "bos_token_id": pad, "eos_token_id": vocab["<|im_end|>"], "pad_token_id": pad},
        vision_config=dict(vision),
        **vision_ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config)
