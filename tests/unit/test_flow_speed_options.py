"""The speed options on the flow-matching transformers (SD 3.5, Flux.1 dev and
schnell, Qwen-Image, Z-Image), on the CPU with their miniatures, as ``test_speed_options``
checks them on the UNet: fused QKV and an SDPA kernel keep the latents within
tolerance; a compiled transformer is compiled as the model loads and never again on
a job, whatever its batch, steps, guidance or prompt's length (Flux.1 dev's guidance
a per-row input; Qwen-Image's texts padded to its longest; Z-Image's blocks compiled
with symbolic lengths, its captions as long as their prompts); SD 3.5 keeps its
attention unfused (diffusers' fused processor drops its QK norms), and so does
Qwen-Image (its processor never reads fused projections), and Z-Image has no fused
projections; int8 and FP8 weights move the latents by a measured, bounded amount."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.denoising.members import BatchMember
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models import speed
from services.models.registry import ModelRegistry
from services.models.spec import ModelSpec
from tests.unit.test_speed_options import TOLERANCE, Compilations, compilations, largest_difference

__all__ = ["compilations"]  # the fixture, shared with test_speed_options

CPU = torch.device("cpu")
MODELS = ["tiny-sd3", "tiny-flux", "tiny-flux-schnell", "tiny-qwen-image", "tiny-z-image"]
UNFUSED = {"tiny-sd3", "tiny-qwen-image", "tiny-z-image"}


def spec_of(model: str, **options: Any) -> ModelSpec:
    return replace(ModelRegistry.load().get(model), **options)


def engine(models_dir: Path, spec: ModelSpec) -> SamplerEngine:
    return SamplerEngine(ModelRegistry({spec.name: spec}), models_dir, CPU)


def jobs(spec: ModelSpec) -> list[GenerationParams]:
    """At the model's default size (where a compiled network was warmed up)."""
    size, g = spec.default_width, spec.default_guidance

    def job(seed: int, images: int = 1, guidance: float = g) -> GenerationParams:
        return GenerationParams(spec.name, "a lighthouse at dusk", "", size, size, 3, guidance, seed, images)

    return [job(1), job(2, images=3), job(3, guidance=1.0)]


def run(e: SamplerEngine, params: list[GenerationParams]) -> list[torch.Tensor]:
    return [e.sample(p, lambda step, total: None, threading.Event()) for p in params]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("options", [{"fuse_qkv": True}, {"attention": "flash"}], ids=["fuse_qkv", "flash"])
def test_an_option_keeps_the_latents_within_tolerance(models_dir: Path, model: str, options: dict[str, Any]) -> None:
    plain = run(engine(models_dir, spec_of(model)), jobs(spec_of(model)))
    e = engine(models_dir, spec_of(model, **options))
    if options.get("fuse_qkv"):
        fused = any(getattr(m, "fused_projections", False) for m in e.load(model).transformer.modules())
        # SD 3.5's QK norms and dual attention are not in diffusers' fused processor, and
        # Qwen-Image's processor reads the unfused projections: they stay unfused. Z-Image's
        # transformer has no fused projections.
        assert fused == (model not in UNFUSED)
    assert largest_difference(run(e, jobs(spec_of(model))), plain) < TOLERANCE


@pytest.mark.parametrize("model", MODELS)
def test_a_compiled_transformer_compiles_as_it_loads_and_never_on_a_job(
    models_dir: Path, model: str, compilations: Compilations
) -> None:
    spec = spec_of(model, optimize=True)
    plain = run(engine(models_dir, spec_of(model)), jobs(spec))
    e = engine(models_dir, spec)
    e.load(model)
    warmed = compilations.graphs
    assert warmed > 0, "compiled as it loaded"
    got = run(e, jobs(spec))
    # Members of other steps, images, guidance and prompts (Z-Image's captions of
    # other lengths) share a batch (as joiners would).
    first, second, _ = jobs(spec)
    longer = replace(first, prompt="a lighthouse on a cliff at dusk, " * 3, negative_prompt="fog", guidance_scale=2.0)
    mixed = [replace(first, steps=first.steps + 2, guidance_scale=first.guidance_scale + 1.0), second, longer]
    batch = e.sample_batch([BatchMember(p, lambda step, total: None, threading.Event()) for p in mixed])
    assert compilations.graphs == warmed, "a job compiled the network again"
    assert all(isinstance(b, torch.Tensor) for b in batch)
    assert largest_difference(got, plain) < TOLERANCE


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("model", MODELS)
def test_quantized_weights_move_the_latents_by_a_measured_bounded_amount(
    models_dir: Path, model: str, kind: str
) -> None:
    plain = run(engine(models_dir, spec_of(model)), jobs(spec_of(model)))
    got = run(engine(models_dir, spec_of(model, quantize=kind)), jobs(spec_of(model)))
    drift = speed.latent_drift(got, plain)
    assert 0.0 < drift < 0.25, f"{kind} moved the latents by {drift:.4f} (relative RMS)"
