"""The flow-matching transformer families (SD 3.5, Flux.1 dev and schnell) in the
sampler's loop, on the CPU with their miniatures: a job's latents are exactly what
the family's diffusers pipeline makes; in a batch of members of other steps,
guidance and seeds, and as a job that joins a running batch at a step boundary,
each member gets exactly its solo latents; a suspended member resumes in another
engine to its uninterrupted latents; a stopped member leaves alone; previews see
the VAE's latents; Flux.1 dev takes its guidance scale as an input (one row each,
no negative prompt) and schnell none."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberResult
from gpu_worker.denoising.running_batch import Cohort, RunningBatch
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.previews import previews
from services.errors import JobInterrupted
from services.generation import GenerationParams
from services.models.flow_tiny import TINY_TEXT_LEN
from services.models.registry import ModelRegistry

CPU = torch.device("cpu")
MODELS = ["tiny-sd3", "tiny-flux", "tiny-flux-schnell"]
PIPELINES = {"tiny-sd3": StableDiffusion3Pipeline, "tiny-flux": FluxPipeline, "tiny-flux-schnell": FluxPipeline}
GUIDANCE = {"tiny-sd3": 4.5, "tiny-flux": 3.5, "tiny-flux-schnell": 1.0}


def params(model: str, seed: int, steps: int = 5, guidance: float | None = None, images: int = 1) -> GenerationParams:
    scale = GUIDANCE[model] if guidance is None else guidance
    return GenerationParams(model, f"a lighthouse {seed}", "", 64, 96, steps, scale, seed, images)


def member(
    p: GenerationParams,
    on_step: Callable[[int, int], None] = lambda step, total: None,
    stopping: threading.Event | None = None,
    **extra: Any,
) -> BatchMember:
    return BatchMember(p, on_step, stopping or threading.Event(), **extra)


def new_engine(models_dir: Path) -> SamplerEngine:
    return SamplerEngine(ModelRegistry.load(), models_dir, CPU)


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return new_engine(models_dir)


def solo(engine: SamplerEngine, p: GenerationParams) -> torch.Tensor:
    return engine.sample(p, lambda step, total: None, threading.Event())


def tensor(result: MemberResult) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), result
    return result


class Departures:
    """What left a running batch, boundary by boundary."""

    def __init__(self) -> None:
        self.cohorts: list[list[tuple[str, MemberResult]]] = []

    def __call__(self, cohort: Cohort) -> None:
        self.cohorts.append([(m.params.prompt, result) for m, result in cohort])

    def of(self, prompt: str) -> MemberResult:
        return next(r for c in self.cohorts for p, r in c if p == prompt)


@pytest.mark.parametrize("model", MODELS)
def test_a_job_gets_exactly_its_pipelines_latents(engine: SamplerEngine, models_dir: Path, model: str) -> None:
    p = params(model, 7, images=2)
    pipe: Any = PIPELINES[model].from_pretrained(models_dir / model)
    pipe.set_progress_bar_config(disable=True)
    generators = [torch.Generator().manual_seed(7 + i) for i in range(2)]
    expected = pipe(
        p.prompt,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        guidance_scale=p.guidance_scale,
        generator=generators,
        num_images_per_prompt=2,
        max_sequence_length=TINY_TEXT_LEN,
        output_type="latent",
    ).images
    if PIPELINES[model] is FluxPipeline:
        expected = pipe._unpack_latents(expected, p.height, p.width, pipe.vae_scale_factor)
    got = solo(engine, p)
    assert got.shape == (2, 16, p.height // 8, p.width // 8)  # what the VAE decodes, packed or not
    assert torch.equal(got, expected)


@pytest.mark.parametrize("model", MODELS)
def test_members_of_other_steps_guidance_and_seeds_each_get_their_solo_latents(
    engine: SamplerEngine, model: str
) -> None:
    g = GUIDANCE[model]
    mixed = [params(model, 1, steps=3), params(model, 2, steps=6, guidance=g + 2), params(model, 3, images=2)]
    left = Departures()
    batch = RunningBatch(mixed[0].join_key, 8, [member(p) for p in mixed], left)
    results = engine.sample_batch([member(p) for p in mixed], batch)
    for p, result in zip(mixed, results, strict=True):
        assert torch.equal(tensor(result), solo(engine, p)), p
    assert [[prompt for prompt, _ in c] for c in left.cohorts] == [
        ["a lighthouse 1"],
        ["a lighthouse 3"],
        ["a lighthouse 2"],
    ]


@pytest.mark.parametrize("model", MODELS)
def test_a_job_offered_mid_batch_joins_at_a_step_boundary_and_gets_its_solo_latents(
    engine: SamplerEngine, model: str
) -> None:
    running, late = params(model, 10, steps=8), params(model, 11, steps=3, guidance=GUIDANCE[model] + 1)
    left = Departures()
    late_steps: list[int] = []

    def on_step(step: int, total: int) -> None:
        if step == 2:
            assert batch.offer([member(late, lambda s, t: late_steps.append(s))]) == 1

    first = member(running, on_step)
    batch = RunningBatch(running.join_key, 8, [first], left)
    results = engine.sample_batch([first], batch)
    assert late_steps == [1, 2, 3]
    assert torch.equal(tensor(left.of(late.prompt)), solo(engine, late))
    assert len(results) == 2 and torch.equal(tensor(results[0]), solo(engine, running))


@pytest.mark.parametrize("model", MODELS)
def test_a_suspended_job_resumes_in_another_engine_to_its_uninterrupted_latents(models_dir: Path, model: str) -> None:
    p = params(model, 21, steps=6, images=2)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 3:
            stop.set()

    [result] = new_engine(models_dir).sample_batch([member(p, on_step, stop, suspend=lambda: True)])
    assert isinstance(result, JobSuspended) and result.checkpoint.step == 3
    [resumed] = new_engine(models_dir).sample_batch([member(p, resume=result.checkpoint)])
    assert torch.equal(tensor(resumed), solo(new_engine(models_dir), p))


@pytest.mark.parametrize("model", MODELS)
def test_a_stopped_member_leaves_and_the_rest_finish(engine: SamplerEngine, model: str) -> None:
    kept, stopped = params(model, 31), params(model, 32)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 2:
            stop.set()

    results = engine.sample_batch([member(kept), member(stopped, on_step, stop)])
    assert isinstance(results[1], JobInterrupted)
    assert torch.equal(tensor(results[0]), solo(engine, kept))


@pytest.mark.parametrize("model", MODELS)
def test_previews_see_the_latents_the_vae_decodes(engine: SamplerEngine, model: str) -> None:
    p = params(model, 41, steps=4, images=2)
    seen: list[tuple[int, torch.Tensor]] = []
    m = member(p, preview_at=frozenset({2}), on_preview=lambda step, total, latents: seen.append((step, latents)))
    [result] = engine.sample_batch([m])
    [(step, latents)] = seen
    assert step == 2 and latents.shape == tensor(result).shape
    spec = engine.registry.get(model)
    images = previews(latents, spec.family, p.width, p.height)
    assert len(images) == 2 and all(image.startswith(b"\xff\xd8") for image in images)  # JPEGs


def test_flux_dev_takes_its_guidance_as_an_input_and_schnell_ignores_it(engine: SamplerEngine) -> None:
    dev = [solo(engine, params("tiny-flux", 5, guidance=g)) for g in (1.0, 3.5)]
    assert not torch.equal(dev[0], dev[1]), "the guidance scale reaches dev's network"
    schnell = [solo(engine, params("tiny-flux-schnell", 5, guidance=g)) for g in (1.0, 3.5)]
    assert torch.equal(schnell[0], schnell[1]), "schnell has no guidance input"


@pytest.mark.parametrize("model", MODELS)
def test_each_prompt_is_encoded_once_and_flux_has_no_negative_half(engine: SamplerEngine, model: str) -> None:
    spec = engine.registry.get(model)
    denoiser = engine.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    p = params(model, 51, guidance=GUIDANCE[model] + 1)
    misses = engine.prompts.misses
    engine.sample_batch([member(p), member(replace(params(model, 52, guidance=p.guidance_scale), prompt=p.prompt))])
    assert engine.prompts.misses == misses + 1, "two members of one prompt: one encoding"
    conditioning = denoiser.encode_cached(engine.load(model), spec, p)
    assert (conditioning.negative_embeds is None) == (spec.family == "flux")
