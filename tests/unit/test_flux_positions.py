"""Flux's position ids, kept on the device per size, are bounded: a client that asks
for a new size with each job (any multiple of the size step within the model's
bounds) leaves at most IMAGE_POSITIONS_KEPT sizes' ids there, the least recently
used going first; a size in use is made once and reused as diffusers makes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import FluxPipeline

from gpu_worker.denoising.prompts import PromptCache
from gpu_worker.families.flux import IMAGE_POSITIONS_KEPT, FluxDenoiser
from services.generation import GenerationParams

CPU = torch.device("cpu")


class Pipe:
    """What the denoiser asks of a Flux pipeline for position ids, counting what it makes."""

    vae_scale_factor = 8

    def __init__(self) -> None:
        self.made: list[tuple[int, int]] = []

    def _prepare_latent_image_ids(self, batch: int, h: int, w: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
        self.made.append((h, w))
        return FluxPipeline._prepare_latent_image_ids(batch, h, w, device, dtype)


def sized(width: int, height: int) -> GenerationParams:
    return GenerationParams("flux-dev", "a fox", "", width, height, 4, 3.5, 1, 1)


def test_position_ids_are_kept_for_a_bounded_number_of_sizes_the_latest_used_last_to_go(tmp_path: Path) -> None:
    denoiser = FluxDenoiser(tmp_path, CPU, PromptCache(0))
    pipe = Pipe()
    square = denoiser._image_positions(pipe, sized(1024, 1024), torch.bfloat16)
    assert torch.equal(square, FluxPipeline._prepare_latent_image_ids(1, 64, 64, CPU, torch.bfloat16))
    for n in range(200):  # a new size with each job
        denoiser._image_positions(pipe, sized(512 + 16 * (n % 50), 512 + 16 * (n // 50)), torch.bfloat16)
        assert denoiser._image_positions(pipe, sized(1024, 1024), torch.bfloat16) is square  # in use: kept
    assert len(denoiser._image_ids) == IMAGE_POSITIONS_KEPT
    assert pipe.made.count((64, 64)) == 1 and len(pipe.made) == 201
