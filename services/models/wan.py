"""Wan 2.1 text-to-video (diffusers' ``WanPipeline``) built from config with random weights, with
no model hub: a tiny one that runs on a CPU in a second or two, for tests, and a full-size copy of
Wan-AI/Wan2.1-T2V-1.3B-Diffusers (its UMT5-XXL text encoder included), for benchmarks and capacity
planning. Their output is noise, by design.

What both keep of the real model: 16 latent channels; a VAE that compresses 4x in time and 8x in
space, so ``num_frames`` must be 4k+1 and gives (num_frames-1)//4+1 latent frames of height/8 x
width/8; a transformer with (1, 2, 2) patches, so height and width must be multiples of 16.

A character-level tokenizer stands in for google/umt5-xxl's SentencePiece one (a download): each
Latin-1 character is a token, anything else ``<unk>``; the full preset keeps UMT5's 256,384-row
embedding table. ``WanPipeline.encode_prompt`` defaults to ``max_sequence_length=226`` where its
``__call__`` (and Wan's training) uses 512: pass 512 to get what ``__call__`` does. Any length
works (UMT5 has relative positions only); the tiny model is quicker with, say, 64.

Denoising outside the pipeline, as ``WanPipeline.__call__`` does it: latents start as float32
N(0, 1) noise of shape (B, 16, frames', h/8, w/8), unscaled; ``scheduler.set_timesteps(n)``, then
for each ``t``: ``transformer(hidden_states=latents.to(its dtype), timestep=t.expand(B),
encoder_hidden_states=prompt_embeds, return_dict=False)[0]`` is the flow velocity; with guidance
> 1 a second call on the negative prompt's states (the empty prompt's by default) gives ``u`` and
``v = u + g * (v - u)``; ``latents = scheduler.step(v, t, latents).prev_sample``. UniPC keeps
state between steps (its previous outputs and sample, ``step_index``): a suspended job must keep
it too. Before ``vae.decode``: ``latents * latents_std + latents_mean``, per channel, from the
VAE's config; the decoded video is in [-1, 1]."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.models.presets import PRESET_MARKER, _diffusers_version, save_network

WAN_TINY_MARKER = "darkroom_tiny_wan.json"
WAN22_TINY_MARKER = "darkroom_tiny_wan22.json"
# Wan 2.2 A14B text-to-video: the high-noise expert (``transformer``) predicts the steps
# whose timestep is at least this share of the training timesteps, the low-noise one
# (``transformer_2``) the rest (Wan-AI/Wan2.2-T2V-A14B-Diffusers' model_index.json).
WAN22_T2V_BOUNDARY = 0.875
WAN_PRESET_MARKER = PRESET_MARKER
TEXT_LEN = 512  # Wan's text_len: the prompt length it was trained with
UMT5_VOCAB = 256384

# The real model's configs: huggingface.co/Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/, vae/,
# text_encoder/config.json and scheduler/scheduler_config.json (the first matches Wan-Video/Wan2.1
# wan/configs/wan_t2v_1_3B.py: dim 1536, 12 heads, 30 layers, ffn 8960). Most keys left at the
# libraries' defaults are omitted; AutoencoderKLWan's default latents_mean/std are Wan 2.1's.
WAN_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
WAN_VAE: dict[str, Any] = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True],
)  # fmt: skip
UMT5_XXL: dict[str, Any] = dict(
    vocab_size=UMT5_VOCAB, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
)  # fmt: skip
# UniPC over flow-matching sigmas: sigma = shift*s / (1 + (shift-1)*s) for s evenly spaced in
# (0, 1]; the model predicts the velocity (noise - x0). The file's beta_* keys (linear,
# 0.0001..0.02) are UniPC's defaults and unused on flow sigmas. flow_shift 3.0 is the 480p value.
WAN_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
    solver_order=2, solver_type="bh2", predict_x0=True, lower_order_final=True, final_sigmas_type="zero",
    timestep_spacing="linspace",
)  # fmt: skip

# The tiny model: two layers each, 32 wide. The VAE keeps all four levels (that is where its 8x
# and 4x come from) at 4 channels: it dominates the run time, growing with width.
TINY_TRANSFORMER: dict[str, Any] = dict(
    WAN_TRANSFORMER, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64,
    num_layers=2, rope_max_seq_len=32,
)  # fmt: skip
TINY_VAE: dict[str, Any] = dict(WAN_VAE, base_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
TINY_TEXT: dict[str, Any] = dict(
    UMT5_XXL, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=32,
)  # fmt: skip


def build_tiny_wan(path: Path, *, seed: int = 0) -> Path:
    """Builds the tiny Wan with random float32 weights and saves it as a diffusers directory at
    ``path``, which ``WanPipeline.from_pretrained(path, local_files_only=True)`` loads."""
    import torch

    tokenizer = t5_tokenizer()
    text = {**TINY_TEXT, "vocab_size": len(tokenizer)}
    _build(Path(path), seed, tokenizer, text, TINY_TRANSFORMER, TINY_VAE, torch.float32)
    note = "random weights: output is noise"
    (Path(path) / WAN_TINY_MARKER).write_text(json.dumps({"seed": seed, "note": note}))
    return Path(path)


def build_tiny_wan22(path: Path, *, seed: int = 0) -> Path:
    """The tiny Wan as Wan 2.2 A14B is made: two experts of the same architecture, each
    with its own random weights, switched at ``WAN22_T2V_BOUNDARY`` (diffusers' ``WanPipeline``
    with ``transformer_2`` and ``boundary_ratio``)."""
    import torch

    tokenizer = t5_tokenizer()
    text = {**TINY_TEXT, "vocab_size": len(tokenizer)}
    _build(Path(path), seed, tokenizer, text, TINY_TRANSFORMER, TINY_VAE, torch.float32, boundary=WAN22_T2V_BOUNDARY)
    note = "random weights: output is noise"
    (Path(path) / WAN22_TINY_MARKER).write_text(json.dumps({"seed": seed, "note": note}))
    return Path(path)


def build_wan_preset(path: Path, *, seed: int = 0) -> Path:
    """Builds the Wan 2.1 T2V 1.3B architecture (with its UMT5-XXL text encoder) with random
    weights and saves it as a bfloat16 diffusers directory at ``path``, one component at a time:
    14 GB on disk, 4 minutes on two cores. The peak memory, 13.9 GB, is the text encoder's 11.4 GB
    (never in float32) and a second embedding table transformers builds before tying it to the
    first. Load it with ``dtype=torch.bfloat16`` (the VAE decodes better in float32)."""
    import torch

    _build(Path(path), seed, t5_tokenizer(), UMT5_XXL, WAN_TRANSFORMER, WAN_VAE, torch.bfloat16)
    note = "random weights"
    (Path(path) / WAN_PRESET_MARKER).write_text(json.dumps({"preset": "wan", "seed": seed, "note": note}))
    return Path(path)


def wan_parameter_counts() -> dict[str, int]:
    """Parameters of each network of the full-size architecture, built on the meta device (no
    memory): what the preset must match."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        networks: dict[str, Any] = {
            "transformer": WanTransformer3DModel(**WAN_TRANSFORMER),
            "text_encoder": UMT5EncoderModel(UMT5Config(**UMT5_XXL)),
            "vae": AutoencoderKLWan(**WAN_VAE),
        }
    return {name: sum(p.numel() for p in net.parameters()) for name, net in networks.items()}


def t5_tokenizer(max_length: int = TEXT_LEN) -> Any:
    """A character-level T5 tokenizer (no download) of prompts up to ``max_length`` tokens: T5's
    ``<pad>`` 0, ``</s>`` 1 (appended to every prompt) and ``<unk>`` 2, the SentencePiece
    word-start mark, then one piece per printable Latin-1 character."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 256) if chr(c).isprintable()]
    # transformers 5's T5Tokenizer is the tokenizers-backed one and takes a Unigram vocabulary
    # as (piece, score) pairs; it saves tokenizer.json, so loading needs no SentencePiece model.
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def _build(
    path: Path,
    seed: int,
    tokenizer: Any,
    text: dict[str, Any],
    transformer: dict[str, Any],
    vae: dict[str, Any],
    dtype: Any,
    *,
    boundary: float | None = None,
) -> None:
    """The directory of a Wan pipeline; with ``boundary``, a second expert (Wan 2.2)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path / "tokenizer")
    save_network(path / "text_encoder", lambda: UMT5EncoderModel(UMT5Config(**text)), dtype)
    save_network(path / "transformer", lambda: WanTransformer3DModel(**transformer), dtype)
    if boundary is not None:
        save_network(path / "transformer_2", lambda: WanTransformer3DModel(**transformer), dtype)
    save_network(path / "vae", lambda: AutoencoderKLWan(**vae), dtype)
    scheduler: Any = UniPCMultistepScheduler(**WAN_SCHEDULER)
    scheduler.save_pretrained(path / "scheduler")
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": _diffusers_version(),
        "boundary_ratio": boundary,  # Wan 2.2's two-expert switch (None: one expert, Wan 2.1)
        "expand_timesteps": False,
        "scheduler": ["diffusers", type(scheduler).__name__],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", type(tokenizer).__name__],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if boundary is not None else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
