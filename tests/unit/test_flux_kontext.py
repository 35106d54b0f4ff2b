"""Flux.1 Kontext's instruction edits in the sampler's loop, on the CPU with its
miniature: an edit's latents are exactly ``FluxKontextPipeline``'s for the same
input latents; in a batch of edits of other images, steps and guidance, each gets
its solo latents; a suspended edit resumes in another engine to its uninterrupted
latents (its input image travels in its checkpoint); a job without an input image
fails alone, as its own fault, naming what it lacks; compiled, it is warmed up with a blank input image
as it loads and no edit compiles it again."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxKontextPipeline

from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberInputs, MemberResult
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.failures import classify
from services.errors import InvalidArgument
from services.generation import GenerationParams
from services.models.flow_tiny import TINY_TEXT_LEN
from services.models.registry import ModelRegistry
from tests.unit.test_speed_options import TOLERANCE, Compilations, compilations

__all__ = ["compilations"]  # the fixture, shared with test_speed_options

MODEL = "tiny-flux-kontext"
CPU = torch.device("cpu")


def params(seed: int, steps: int = 4, guidance: float = 2.5, images: int = 1) -> GenerationParams:
    return GenerationParams(MODEL, f"make it night {seed}", "", 64, 96, steps, guidance, seed, images)


def image(seed: int) -> MemberInputs:
    """An input image's latents as the decoder's VAE encodes one: (1, 16, H/8, W/8)."""
    return MemberInputs(image_latents=torch.randn(1, 16, 12, 8, generator=torch.Generator().manual_seed(seed)))


def member(p: GenerationParams, inputs: MemberInputs | None, **extra: Any) -> BatchMember:
    on_step = extra.pop("on_step", lambda step, total: None)
    return BatchMember(p, on_step, extra.pop("stopping", threading.Event()), inputs=inputs, **extra)


def new_engine(models_dir: Path) -> SamplerEngine:
    return SamplerEngine(ModelRegistry.load(), models_dir, CPU)


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return new_engine(models_dir)


def solo(engine: SamplerEngine, p: GenerationParams, inputs: MemberInputs) -> torch.Tensor:
    [result] = engine.sample_batch([member(p, inputs)])
    return tensor(result)


def tensor(result: MemberResult) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), result
    return result


def test_an_edit_gets_exactly_its_pipelines_latents(engine: SamplerEngine, models_dir: Path) -> None:
    p, inputs = params(3, images=2), image(1)
    pipe: Any = FluxKontextPipeline.from_pretrained(models_dir / MODEL)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        image=inputs.image_latents,
        prompt=p.prompt,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        guidance_scale=p.guidance_scale,
        generator=[torch.Generator().manual_seed(3 + i) for i in range(2)],
        num_images_per_prompt=2,
        max_sequence_length=TINY_TEXT_LEN,
        output_type="latent",
        _auto_resize=False,
        max_area=p.width * p.height,  # else it makes the area of 1024x1024
    ).images
    expected = pipe._unpack_latents(expected, p.height, p.width, pipe.vae_scale_factor)
    assert torch.equal(solo(engine, p, inputs), expected)
    assert not torch.equal(solo(engine, p, image(2)), expected), "the input image reaches the network"


def test_edits_of_other_images_steps_and_guidance_each_get_their_solo_latents(engine: SamplerEngine) -> None:
    jobs = [(params(1), image(1)), (params(2, steps=6, guidance=4.0), image(2)), (params(3, images=2), image(3))]
    results = engine.sample_batch([member(p, i) for p, i in jobs])
    for (p, inputs), result in zip(jobs, results, strict=True):
        assert torch.equal(tensor(result), solo(engine, p, inputs))


def test_a_suspended_edit_resumes_in_another_engine_to_its_uninterrupted_latents(models_dir: Path) -> None:
    p, inputs = params(9, steps=6), image(9)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 2:
            stop.set()

    [result] = new_engine(models_dir).sample_batch(
        [member(p, inputs, on_step=on_step, stopping=stop, suspend=lambda: True)]
    )
    assert isinstance(result, JobSuspended) and result.checkpoint.step == 2
    # The resumed job is given no inputs: its image comes back from the checkpoint.
    [resumed] = new_engine(models_dir).sample_batch([member(p, None, resume=result.checkpoint)])
    assert torch.equal(tensor(resumed), solo(new_engine(models_dir), p, inputs))


def test_a_job_without_an_input_image_fails_alone_naming_it(engine: SamplerEngine) -> None:
    results = engine.sample_batch([member(params(1), None), member(params(2), image(2))])
    # The job's own fault: never retried, and no sign that the worker is unfit.
    assert isinstance(results[0], InvalidArgument) and [v.field for v in results[0].violations] == ["image"]
    assert not classify(results[0]).retryable and not classify(results[0]).blames_worker
    assert torch.equal(tensor(results[1]), solo(engine, params(2), image(2)))


def test_a_compiled_kontext_compiles_as_it_loads_and_never_on_an_edit(
    models_dir: Path, compilations: Compilations
) -> None:
    spec = replace(ModelRegistry.load().get(MODEL), optimize=True)
    compiled = SamplerEngine(ModelRegistry({MODEL: spec}), models_dir, CPU)
    compiled.load(MODEL)  # warmed up with a blank input image at the model's default size
    warmed = compilations.graphs
    assert warmed > 0
    size = spec.default_width
    p = GenerationParams(MODEL, "make it night", "", size, size, 3, 2.5, 1, 1)
    inputs = MemberInputs(image_latents=torch.randn(1, 16, size // 8, size // 8))
    [plain] = new_engine(models_dir).sample_batch([member(p, inputs)])
    [result] = compiled.sample_batch([member(p, inputs), member(replace(p, guidance_scale=4.0, seed=2), inputs)])[:1]
    assert compilations.graphs == warmed, "an edit compiled the network again"
    assert float((tensor(result) - tensor(plain)).abs().max()) < TOLERANCE
