"""Loading models from several threads at once, as a sampler with a local decoder
does: every model arrives whole, and nothing is left on the meta device."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gpu_worker.engine import SamplerEngine
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine


def test_concurrent_loads_leave_no_meta_tensors(models_dir: Path) -> None:
    registry = ModelRegistry.load()
    cpu = torch.device("cpu")

    def load(i: int) -> list[torch.nn.Module]:
        if i % 2:
            return [VaeDecoderEngine(registry, models_dir, cpu).load("tiny")]
        pipe = SamplerEngine(registry, models_dir, cpu).load("tiny")
        return [pipe.unet, pipe.text_encoder]

    for _ in range(3):
        with ThreadPoolExecutor(6) as pool:
            modules = [m for loaded in pool.map(load, range(6)) for m in loaded]
        assert all(p.device.type == "cpu" for m in modules for p in m.parameters())
        assert torch.empty(1).device.type == "cpu"
