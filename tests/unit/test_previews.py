"""Previews of images while they denoise: when they are taken, and what they are."""

from __future__ import annotations

import io

import torch
from PIL import Image

from gpu_worker.previews import preview_steps, previews
from services.models.registry import ModelFamily


def test_previews_are_evenly_spaced_and_never_the_last_step() -> None:
    assert preview_steps(30, 2) == {10, 20}
    assert preview_steps(30, 0) == frozenset()
    assert preview_steps(2, 3) == {1}, "steps too few for three: those there are"


def test_a_preview_is_a_jpeg_of_the_images_size_that_follows_the_latents() -> None:
    latents = torch.zeros(2, 4, 8, 8)
    latents[1, 0] = 2.0  # SD's first latent channel leans every colour up
    dark, bright = (Image.open(io.BytesIO(p)) for p in previews(latents, ModelFamily.TINY, 64, 48))
    assert (dark.format, dark.size) == ("JPEG", (64, 48))
    assert sum(bright.convert("L").getdata()) > sum(dark.convert("L").getdata())
    sdxl = previews(latents, ModelFamily.SDXL, 64, 48)
    assert sdxl[1] != previews(latents, ModelFamily.SD15, 64, 48)[1], "SDXL's latent space has its own colours"
