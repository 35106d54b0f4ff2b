"""Loading models from several threads at once, as a sampler with a local decoder
does: every model arrives whole, nothing is left on the meta device, and a store
model's download holds up no other load."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from gpu_worker.engine import SamplerEngine
from services.models import loader
from services.models.host_cache import loading
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


def test_a_store_models_download_holds_up_no_other_load(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = ModelRegistry.load().get("tiny")
    stored = dataclasses.replace(tiny, name="tiny-stored", source="store:tiny-stored")
    downloading, downloaded = threading.Event(), threading.Event()

    def slow_store(model: str, name: str, version: str | None) -> Path:
        downloading.set()
        assert downloaded.wait(60)
        return models_dir / "tiny"

    monkeypatch.setattr(loading, "model_dir", slow_store)
    cpu = torch.device("cpu")
    with ThreadPoolExecutor(2) as pool:
        from_store = pool.submit(
            loader.load, UNet2DConditionModel, stored, models_dir, cpu, dtype=torch.float32, subfolder="unet"
        )
        assert downloading.wait(60)
        # While the store model downloads, another model of the process loads.
        other = pool.submit(
            loader.load, UNet2DConditionModel, tiny, models_dir, cpu, dtype=torch.float32, subfolder="unet"
        )
        try:
            assert isinstance(other.result(timeout=60).value, UNet2DConditionModel)
        finally:
            downloaded.set()
        assert isinstance(from_store.result(timeout=60).value, UNet2DConditionModel)
