"""The Wan 2.1 models Darkroom builds itself: the tiny one loads and generates through diffusers'
own ``WanPipeline``; the full-size preset has the real architecture's parameter counts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from services.models.wan import WAN_TINY_MARKER, build_tiny_wan, wan_parameter_counts

# The published models' counts: Wan-AI/Wan2.1-T2V-1.3B's transformer (the Hub's metadata, and
# its float32 safetensors of 5,676,070,424 bytes), the UMT5-XXL encoder Wan ships
# (models_t5_umt5-xxl-enc-bf16), and the Wan 2.1 VAE.
PUBLISHED = {"transformer": 1_418_996_800, "text_encoder": 5_680_910_336, "vae": 126_892_531}


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Any:
    from diffusers import WanPipeline

    path = build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"))
    assert (path / WAN_TINY_MARKER).exists()
    pipe = WanPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe: Any, seed: int = 0) -> np.ndarray:
    out = pipe(
        prompt="a red fox runs through snow",
        num_frames=9,
        height=64,
        width=64,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(seed),
    )
    return np.asarray(out.frames)


def test_the_tiny_wan_generates_a_video_of_the_asked_shape(pipe: Any) -> None:
    seen: list[tuple[int, ...]] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append(tuple(kwargs["hidden_states"].shape)), with_kwargs=True
    )
    try:
        frames = _generate(pipe)
    finally:
        hook.remove()
    assert frames.shape == (1, 9, 64, 64, 3)
    assert np.isfinite(frames).all()
    # 9 frames are 3 latent frames (4x in time), 64 pixels 8 latents (8x in space), 16 channels;
    # two steps, each with and without the prompt (classifier-free guidance).
    assert seen == [(1, 16, 3, 8, 8)] * 4


def test_the_same_seed_gives_the_same_frames(pipe: Any) -> None:
    first, second = _generate(pipe, seed=7), _generate(pipe, seed=7)
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, _generate(pipe, seed=8))


def test_encode_prompt_gives_the_text_encoder_states(pipe: Any) -> None:
    prompt, negative = pipe.encode_prompt("a red fox", max_sequence_length=64)
    assert prompt.shape == negative.shape == (1, 64, pipe.text_encoder.config.d_model)
    # One token a character, one a word start, and </s>; past them the pipeline zeroes the states.
    tokens = pipe.tokenizer("a red fox").input_ids
    assert len(tokens) == 7 + 3 + 1 and tokens[-1] == pipe.tokenizer.eos_token_id
    assert prompt[0, : len(tokens)].abs().sum(dim=-1).gt(0).all()
    assert prompt[0, len(tokens) :].abs().sum() == 0


def test_the_preset_has_the_real_parameter_counts() -> None:
    counts = wan_parameter_counts()
    assert counts.keys() == PUBLISHED.keys()
    for name, published in PUBLISHED.items():
        assert counts[name] == pytest.approx(published, rel=0.01), name
