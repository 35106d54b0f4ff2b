"""Z-Image in the sampler's loop, on the CPU with its miniature: a job's latents are
exactly ``ZImagePipeline``'s for the same seeds (Turbo's no guidance, guidance with
and without a negative prompt, capped by cfg_normalization); in a batch of members
of other steps, guidance, seeds and prompts (captions of other lengths), and as a
job that joins a running batch at a step boundary, each member gets exactly its
solo latents; a suspended member resumes in another engine to its uninterrupted
latents; a stopped member leaves alone; previews see the VAE's latents; a prompt
is encoded once, with a negative half only where guidance is on."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import ZImagePipeline

from gpu_worker.denoising.members import JobSuspended
from gpu_worker.denoising.running_batch import RunningBatch
from gpu_worker.engine import SamplerEngine
from gpu_worker.families.z_image import ZImageDenoiser
from gpu_worker.jobs.previews import previews
from services.errors import JobInterrupted
from services.generation import GenerationParams
from services.models.registry import ModelRegistry
from services.models.z_image import TINY_Z_IMAGE_TEXT_LEN
from tests.unit.test_flow_families import CPU, Departures, member, solo, tensor

MODEL = "tiny-z-image"
GUIDANCE = 3.0  # Z-Image's own (not Turbo's) range: guidance on


def params(
    seed: int, steps: int = 4, guidance: float = 0.0, images: int = 1, prompt: str = "", negative: str = ""
) -> GenerationParams:
    text = prompt or f"a lighthouse {seed}"
    return GenerationParams(MODEL, text, negative, 64, 96, steps, guidance, seed, images)


def new_engine(models_dir: Path, **options: Any) -> SamplerEngine:
    registry = ModelRegistry.load()
    spec = replace(registry.get(MODEL), **options)
    return SamplerEngine(ModelRegistry({MODEL: spec}), models_dir, CPU)


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return new_engine(models_dir)


def pipeline_latents(models_dir: Path, p: GenerationParams, **call: Any) -> torch.Tensor:
    pipe: Any = ZImagePipeline.from_pretrained(models_dir / MODEL)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        p.prompt,
        negative_prompt=p.negative_prompt or None,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        guidance_scale=p.guidance_scale,
        generator=[torch.Generator().manual_seed(p.seed + i) for i in range(p.num_images)],
        num_images_per_prompt=p.num_images,
        max_sequence_length=TINY_Z_IMAGE_TEXT_LEN,
        output_type="latent",
        **call,
    ).images


@pytest.mark.parametrize(
    ("guidance", "negative"), [(0.0, ""), (GUIDANCE, ""), (GUIDANCE, "fog, a long negative prompt")]
)
def test_a_job_gets_exactly_its_pipelines_latents(
    engine: SamplerEngine, models_dir: Path, guidance: float, negative: str
) -> None:
    p = params(7, guidance=guidance, images=2, negative=negative)
    expected = pipeline_latents(models_dir, p)
    got = solo(engine, p)
    assert got.shape == (2, 16, p.height // 8, p.width // 8) and got.dtype == torch.float32
    assert torch.equal(got, expected)


def test_cfg_normalization_caps_the_guided_prediction_as_the_pipeline_does(models_dir: Path) -> None:
    p = params(8, guidance=8.0)
    capped = solo(new_engine(models_dir, cfg_normalization=1.0), p)
    assert torch.equal(capped, pipeline_latents(models_dir, p, cfg_normalization=1.0))
    assert not torch.equal(capped, pipeline_latents(models_dir, p)), "the cap changes this job's latents"


def test_members_of_other_steps_guidance_seeds_and_prompts_each_get_their_solo_latents(
    engine: SamplerEngine,
) -> None:
    mixed = [
        params(1, steps=3),
        params(2, steps=6, guidance=GUIDANCE, prompt="a much longer prompt: a lighthouse on a cliff at dusk"),
        params(3, images=2, guidance=GUIDANCE + 1, negative="fog"),
        params(4, steps=5),
    ]
    left = Departures()
    batch = RunningBatch(mixed[0].join_key, 8, [member(p) for p in mixed], left)
    results = engine.sample_batch([member(p) for p in mixed], batch)
    for p, result in zip(mixed, results, strict=True):
        assert torch.equal(tensor(result), solo(engine, p)), p
    assert [sorted(prompt for prompt, _ in c) for c in left.cohorts] == [
        ["a lighthouse 1"],
        ["a lighthouse 3"],
        ["a lighthouse 4"],
        [mixed[1].prompt],
    ]


def test_a_job_offered_mid_batch_joins_at_a_step_boundary_and_gets_its_solo_latents(engine: SamplerEngine) -> None:
    running, late = params(10, steps=6), params(11, steps=3, guidance=GUIDANCE)
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


@pytest.mark.parametrize("guidance", [0.0, GUIDANCE])
def test_a_suspended_job_resumes_in_another_engine_to_its_uninterrupted_latents(
    models_dir: Path, guidance: float
) -> None:
    p = params(21, steps=6, guidance=guidance, images=2)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 3:
            stop.set()

    [result] = new_engine(models_dir).sample_batch([member(p, on_step, stop, suspend=lambda: True)])
    assert isinstance(result, JobSuspended) and result.checkpoint.step == 3
    [resumed] = new_engine(models_dir).sample_batch([member(p, resume=result.checkpoint)])
    assert torch.equal(tensor(resumed), solo(new_engine(models_dir), p))


def test_a_stopped_member_leaves_and_the_rest_finish(engine: SamplerEngine) -> None:
    kept, stopped = params(31, guidance=GUIDANCE), params(32)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 2:
            stop.set()

    results = engine.sample_batch([member(kept), member(stopped, on_step, stop)])
    assert isinstance(results[1], JobInterrupted)
    assert torch.equal(tensor(results[0]), solo(engine, kept))


def test_previews_see_the_latents_the_vae_decodes(engine: SamplerEngine) -> None:
    p = params(41, steps=4, images=2)
    seen: list[tuple[int, torch.Tensor]] = []
    m = member(p, preview_at=frozenset({2}), on_preview=lambda step, total, latents: seen.append((step, latents)))
    [result] = engine.sample_batch([m])
    [(step, latents)] = seen
    assert step == 2 and latents.shape == tensor(result).shape
    spec = engine.registry.get(MODEL)
    assert spec.previews
    images = previews(latents, spec.family, p.width, p.height)
    assert len(images) == 2 and all(image.startswith(b"\xff\xd8") for image in images)  # JPEGs


@pytest.mark.parametrize("guidance", [0.0, GUIDANCE])
def test_each_prompt_is_encoded_once_with_a_negative_half_only_under_guidance(
    engine: SamplerEngine, guidance: float
) -> None:
    spec = engine.registry.get(MODEL)
    denoiser = engine.denoiser_for(spec)
    assert isinstance(denoiser, ZImageDenoiser)
    p = params(51, guidance=guidance, prompt=f"one prompt, guidance {guidance}")
    misses = engine.prompts.misses
    engine.sample_batch([member(p), member(params(52, guidance=guidance, prompt=p.prompt))])
    assert engine.prompts.misses == misses + 1, "two members of one prompt: one encoding"
    conditioning = denoiser.encode_cached(engine.load(MODEL), spec, p)
    assert (conditioning.negative_embeds is None) == (guidance == 0.0)
    assert conditioning.embeds is not None and conditioning.text_lengths is not None
    # The caption is the prompt's own tokens, chat template included: no padding.
    assert conditioning.embeds.shape[1] == int(conditioning.text_lengths[0]) < TINY_Z_IMAGE_TEXT_LEN


def test_guidance_is_on_above_zero_and_turbo_runs_without(engine: SamplerEngine) -> None:
    outputs = [solo(engine, params(61, guidance=g)) for g in (0.0, 1.0, GUIDANCE)]
    assert not torch.equal(outputs[0], outputs[1]), "a scale of 1 guides (cond + 1 * (cond - uncond))"
    assert not torch.equal(outputs[1], outputs[2])
