"""The SD 1.5 preset, built for real: a diffusers directory both services load
through the registry, and a generation through them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.loader import module_bytes
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine

pytestmark = pytest.mark.integration


def test_the_sd15_preset_builds_once_and_runs(tmp_path: Path) -> None:
    """Over 30 s: it builds a full-size SD 1.5 network with random weights (about 1 GB) and
    runs it on the CPU."""
    registry = ModelRegistry({"sd15-random": ModelRegistry.load(presets=None).get("sd15-random")})
    engine = SamplerEngine(registry, tmp_path, torch.device("cpu"))
    pipe = engine.load("sd15-random")
    built = tmp_path / "sd15-random"
    assert json.loads((built / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    # The sampler loads text encoder and UNet: the real 123M + 860M parameters, float32
    # on a CPU, and CLIP's position ids (a buffer of 77 int64).
    assert module_bytes(pipe) == (123_060_480 + 859_520_964) * 4 + 77 * 8
    latents = engine.sample(
        GenerationParams("sd15-random", "a cat", "", 64, 64, 2, 7.5, 1, 1), lambda s, t: None, threading.Event()
    )
    assert latents.shape == (1, 4, 8, 8)
    [image] = VaeDecoderEngine(registry, tmp_path, torch.device("cpu")).decode_images("sd15-random", latents)
    assert image.pixels.shape == (64, 64, 3) and not image.fault
    # Built once: a second engine finds the directory and does not rebuild it.
    mtime = (built / "model_index.json").stat().st_mtime
    SamplerEngine(registry, tmp_path, torch.device("cpu")).load("sd15-random")
    assert (built / "model_index.json").stat().st_mtime == mtime
