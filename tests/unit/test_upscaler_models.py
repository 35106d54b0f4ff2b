"""The x4 upscaler: the tiny one loads through diffusers and upscales 4x on a CPU; the full-size
one has the published model's architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from services.models.upscaler import UPSCALER_TINY_MARKER, build_tiny_upscaler, upscaler_parameter_counts

# huggingface.co/stabilityai/stable-diffusion-x4-upscaler publishes no parameter counts, only its
# files' sizes: unet 947 MB and vae 111 MB in float16, text_encoder 1.36 GB in float32.
PUBLISHED = {"unet": 947_000_000 // 2, "vae": 111_000_000 // 2, "text_encoder": 1_360_000_000 // 4}


def _image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _upscale(pipe: Any, image: Image.Image, seed: int = 0) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    out = pipe(prompt="a photo", image=image, num_inference_steps=4, output_type="np", generator=generator)
    return np.asarray(out.images)


def test_the_tiny_upscaler_loads_and_upscales_an_image_4x(tmp_path: Path) -> None:
    from diffusers import StableDiffusionUpscalePipeline

    path = build_tiny_upscaler(tmp_path / "tiny-upscaler")
    assert (path / UPSCALER_TINY_MARKER).exists()
    pipe = StableDiffusionUpscalePipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert (pipe.unet.config.in_channels, pipe.config.max_noise_level, pipe.vae_scale_factor) == (7, 350, 4)

    first = _upscale(pipe, _image(0))
    assert first.shape == (1, 128, 128, 3)
    assert np.isfinite(first).all()
    assert np.array_equal(first, _upscale(pipe, _image(0)))
    assert not np.allclose(first, _upscale(pipe, _image(1)))


def test_the_full_size_upscaler_has_the_published_parameter_counts() -> None:
    counts = upscaler_parameter_counts()
    assert counts.keys() == PUBLISHED.keys()
    for name, published in PUBLISHED.items():
        assert counts[name] == pytest.approx(published, rel=0.01), name
