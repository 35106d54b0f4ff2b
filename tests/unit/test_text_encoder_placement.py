"""Where a model's text encoders run (``text_encoders`` in the registry): beside the
network on the device (the default), or on the host, where they take none of the
device's memory and each prompt's conditioning is moved to the device once. The
meta device stands for a GPU: the network is there, host encoders are not, the
device's bytes counted are the network's alone, and the loop still reads nothing
back. On the CPU, host placement gives the same latents."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_worker.denoising.checkpoint_capture import CheckpointPolicy, MemberCheckpoints
from gpu_worker.denoising.diffusers_denoiser import TEXT_ENCODERS, DiffusersDenoiser
from gpu_worker.denoising.members import BatchMember
from gpu_worker.engine import SamplerEngine
from services.errors import ModelError
from services.generation import GenerationParams
from services.models.loader import module_bytes
from services.models.registry import ModelRegistry

META = torch.device("meta")
MODELS = ["tiny", "tiny-sd3", "tiny-flux"]


def engine(models_dir: Path, model: str, place: str, device: torch.device) -> SamplerEngine:
    spec = replace(ModelRegistry.load().get(model), text_encoders=place)
    return SamplerEngine(ModelRegistry({model: spec}), models_dir, device)


def job(model: str, seed: int = 1) -> GenerationParams:
    return GenerationParams(model, "a lighthouse", "", 64, 64, 3, 3.5, seed, 1)


@pytest.mark.parametrize("model", MODELS)
def test_host_encoders_stay_off_the_device_and_out_of_its_bytes(models_dir: Path, model: str) -> None:
    on_device = engine(models_dir, model, "device", META)
    on_host = engine(models_dir, model, "host", META)
    pipe = on_host.load(model)
    encoders = [getattr(pipe, name) for name in TEXT_ENCODERS if getattr(pipe, name, None) is not None]
    assert encoders and all(next(e.parameters()).device.type == "cpu" for e in encoders)
    denoiser = on_host.denoiser_for(on_host.registry.get(model))
    assert isinstance(denoiser, DiffusersDenoiser)
    assert denoiser.network(pipe).device == META
    on_device.load(model)
    [device_bytes] = [m["bytes"] for m in on_device.models.footprints().values()]
    [host_bytes] = [m["bytes"] for m in on_host.models.footprints().values()]
    # The device holds the network alone (the VAE lives in the decoder service).
    assert host_bytes == module_bytes(denoiser.network(pipe)) < device_bytes
    # A job encodes on the host, and its loop runs on the device.
    spec = on_host.registry.get(model)
    conditioning = denoiser.encode_cached(pipe, spec, job(model))
    assert conditioning.embeds is not None and conditioning.embeds.device == META
    member = BatchMember(job(model), lambda step, total: None, threading.Event())
    [run] = denoiser.denoise(pipe, spec, [member], MemberCheckpoints(META, CheckpointPolicy()))
    assert run.result is None and run.state is not None and run.state.latents.device == META


@pytest.mark.parametrize("model", MODELS)
def test_on_the_cpu_host_encoders_give_the_same_latents(models_dir: Path, model: str) -> None:
    cpu = torch.device("cpu")
    results = [
        engine(models_dir, model, place, cpu).sample(job(model), lambda step, total: None, threading.Event())
        for place in ("device", "host")
    ]
    assert torch.equal(results[0], results[1])


def test_the_registry_refuses_another_place_by_name(tmp_path: Path) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text('[models.m]\nsource = "builtin:tiny"\nfamily = "tiny"\ntext_encoders = "gpu"\n')
    with pytest.raises(ModelError, match="text_encoders 'gpu'"):
        ModelRegistry.load(registry)
