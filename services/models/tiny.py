"""A tiny Stable-Diffusion-shaped model built from config with random weights.

It exists so that tests and the demo exercise the real loading path
(``save_pretrained`` then ``from_pretrained(..., local_files_only=True)``) on a
machine with no network to model hubs. Its weights are random: its output is
noise, by design.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

TINY_MARKER = "darkroom_tiny.json"


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte-to-printable-character table, used by CLIP.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_vocab() -> dict[str, int]:
    # CLIP's tokenizer is byte-level BPE; with every byte (and its end-of-word
    # form) in the vocabulary and no merges it tokenizes any text, one token per
    # character, which is all a random-weight model needs.
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny model and save it as a diffusers directory at ``path``."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

    torch.manual_seed(seed)
    path = Path(path)
    tokenizer, text_encoder = _text_parts()
    unet, vae = _unet(), _vae()
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path)  # type: ignore[attr-defined]
    (path / TINY_MARKER).write_text(json.dumps({"seed": seed, "note": "random weights: output is noise"}))
    return path


def _text_parts() -> tuple[Any, Any]:
    """A byte-level CLIP tokenizer and a two-layer CLIP text encoder."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = _byte_level_vocab()
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = Path(tmp) / "vocab.json"
        merges_file = Path(tmp) / "merges.txt"
        vocab_file.write_text(json.dumps(vocab))
        merges_file.write_text("#version: 0.2\n")
        tokenizer = CLIPTokenizer(str(vocab_file), str(merges_file), model_max_length=77)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=vocab["<|endoftext|>"],
            pad_token_id=vocab["<|endoftext|>"],
        )
    )
    return tokenizer, text_encoder


def _unet() -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def _vae() -> Any:
    from diffusers import AutoencoderKL

    # Four blocks give the same 8x spatial compression as SD 1.5, so latents
    # have the shape a real model's would for the same image size.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(16, 16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=128,
    )
