"""Qwen-Image in the sampler's loop, on the CPU with its miniature, as
test_flow_families checks SD 3.5 and Flux.1: a job's latents are exactly what
``QwenImagePipeline`` makes, guided (true classifier-free guidance with a negative
prompt, rescaled to the prompt's norm) or not; in a batch of members of other
steps, guidance, seeds and prompts (texts of other lengths), and as a job that
joins a running batch at a step boundary, each member gets exactly its solo
latents; a suspended member resumes in another engine to its uninterrupted
latents; a stopped member leaves alone; each prompt is encoded once; the decoder's
VAE makes the pipeline's image of the latents, and encodes an image back."""

from __future__ import annotations

import io
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from PIL import Image

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.members import JobSuspended
from gpu_worker.denoising.running_batch import RunningBatch
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.previews import previews
from services.errors import JobInterrupted
from services.generation import GenerationParams
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from tests.unit.test_flow_families import Departures, member, new_engine, tensor

CPU = torch.device("cpu")
MODEL = "tiny-qwen-image"
GUIDANCE = 4.0


def params(
    seed: int, steps: int = 4, guidance: float = GUIDANCE, images: int = 1, negative: str = "", prompt: str = ""
) -> GenerationParams:
    text = prompt or f"a lighthouse {seed}"
    return GenerationParams(MODEL, text, negative, 64, 96, steps, guidance, seed, images)


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return new_engine(models_dir)


@pytest.fixture(scope="module")
def pipe(models_dir: Path) -> Any:
    loaded: Any = QwenImagePipeline.from_pretrained(models_dir / MODEL, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    return loaded


def solo(engine: SamplerEngine, p: GenerationParams) -> torch.Tensor:
    return engine.sample(p, lambda step, total: None, threading.Event())


def pipeline_latents(pipe: Any, p: GenerationParams) -> torch.Tensor:
    """What ``QwenImagePipeline`` makes of ``p``, as the decoder's VAE takes it: (N, 16, H/8, W/8)."""
    guided = p.guidance_scale > 1.0
    generators = [torch.Generator().manual_seed(p.seed + i) for i in range(p.num_images)]
    packed = pipe(
        p.prompt,
        negative_prompt=(p.negative_prompt or " ") if guided else None,
        true_cfg_scale=p.guidance_scale,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        generator=generators,
        num_images_per_prompt=p.num_images,
        output_type="latent",
    ).images
    return pipe._unpack_latents(packed, p.height, p.width, pipe.vae_scale_factor)[:, :, 0]


@pytest.mark.parametrize("guidance", [GUIDANCE, 1.0], ids=["true-cfg", "unguided"])
def test_a_job_gets_exactly_its_pipelines_latents(engine: SamplerEngine, pipe: Any, guidance: float) -> None:
    p = params(7, guidance=guidance, images=2)
    got = solo(engine, p)
    assert got.shape == (2, 16, p.height // 8, p.width // 8)
    assert torch.equal(got, pipeline_latents(pipe, p))


def test_the_negative_prompt_guides_and_the_guidance_is_norm_preserving(engine: SamplerEngine, pipe: Any) -> None:
    p = params(8, negative="fog, blur")
    guided = solo(engine, p)
    assert torch.equal(guided, pipeline_latents(pipe, p)), "the pipeline's own true CFG, negative prompt and all"
    assert not torch.equal(guided, solo(engine, replace(p, negative_prompt=""))), "the negative prompt reaches it"
    assert not torch.equal(guided, solo(engine, replace(p, guidance_scale=1.0))), "guidance changes the image"
    spec = engine.registry.get(MODEL)
    denoiser = engine.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    uncond, cond = torch.randn(2, 1, 6, 64).unbind()
    combined = denoiser.combine_guidance(None, uncond, cond, 4.0)
    assert torch.allclose(combined.norm(dim=-1), cond.norm(dim=-1)), "each token keeps the prompt's norm"
    linear = uncond + 4.0 * (cond - uncond)
    assert torch.allclose(combined / combined.norm(dim=-1, keepdim=True), linear / linear.norm(dim=-1, keepdim=True))


def test_members_of_other_steps_guidance_seeds_and_prompts_each_get_their_solo_latents(engine: SamplerEngine) -> None:
    mixed = [
        params(1, steps=3),
        params(2, steps=6, guidance=GUIDANCE + 2, negative="a storm at night over the sea"),
        params(3, images=2, prompt="a much longer prompt: a lighthouse on a cliff at dusk, waves below"),
        params(4, guidance=1.0),
    ]
    left = Departures()
    batch = RunningBatch(mixed[0].join_key, 8, [member(p) for p in mixed], left)
    results = engine.sample_batch([member(p) for p in mixed], batch)
    for p, result in zip(mixed, results, strict=True):
        assert torch.equal(tensor(result), solo(engine, p)), p
    assert [sorted(prompt for prompt, _ in c) for c in left.cohorts] == [
        ["a lighthouse 1"],
        sorted([mixed[2].prompt, "a lighthouse 4"]),
        ["a lighthouse 2"],
    ]


def test_one_call_for_all_texts_pads_and_masks_them_to_each_members_latents(models_dir: Path) -> None:
    """As on an accelerator: the members and both halves of their guided steps in one
    call, each text padded to the longest and masked. Within float tolerance of each
    one's solo latents (kernels block a larger batch differently); the padding unmasked
    would move them far more."""
    fused = new_engine(models_dir)
    denoiser = fused.denoiser_for(fused.registry.get(MODEL))
    assert isinstance(denoiser, DiffusersDenoiser)
    denoiser.fuse_batches = denoiser.halves_share_call = True
    mixed = [
        params(1),
        params(2, negative="a storm at night over the sea", prompt="a lighthouse on a cliff at dusk, waves below"),
        params(3, guidance=GUIDANCE + 2, images=2),
    ]
    results = fused.sample_batch([member(p) for p in mixed])
    alone = new_engine(models_dir)
    for p, result in zip(mixed, results, strict=True):
        torch.testing.assert_close(tensor(result), solo(alone, p), rtol=0, atol=1e-4)


def test_a_job_offered_mid_batch_joins_at_a_step_boundary_and_gets_its_solo_latents(engine: SamplerEngine) -> None:
    running, late = params(10, steps=6), params(11, steps=3, guidance=GUIDANCE + 1, negative="rain")
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


def test_a_suspended_job_resumes_in_another_engine_to_its_uninterrupted_latents(models_dir: Path) -> None:
    p = params(21, steps=6, images=2)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 3:
            stop.set()

    [result] = new_engine(models_dir).sample_batch([member(p, on_step, stop, suspend=lambda: True)])
    assert isinstance(result, JobSuspended) and result.checkpoint.step == 3
    [resumed] = new_engine(models_dir).sample_batch([member(p, resume=result.checkpoint)])
    assert torch.equal(tensor(resumed), solo(new_engine(models_dir), p))


def test_a_stopped_member_leaves_and_the_rest_finish(engine: SamplerEngine) -> None:
    kept, stopped = params(31), params(32)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 2:
            stop.set()

    results = engine.sample_batch([member(kept), member(stopped, on_step, stop)])
    assert isinstance(results[1], JobInterrupted)
    assert torch.equal(tensor(results[0]), solo(engine, kept))


def test_each_prompt_is_encoded_once_with_its_negative_half(engine: SamplerEngine) -> None:
    spec = engine.registry.get(MODEL)
    denoiser = engine.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    p = params(51, guidance=GUIDANCE + 1)
    misses = engine.prompts.misses
    engine.sample_batch([member(p), member(replace(params(52, guidance=p.guidance_scale), prompt=p.prompt))])
    assert engine.prompts.misses == misses + 1, "two members of one prompt: one encoding"
    conditioning = denoiser.encode_cached(engine.load(MODEL), spec, p)
    assert conditioning.embeds is not None and conditioning.negative_embeds is not None
    assert conditioning.embeds.shape[1] != conditioning.negative_embeds.shape[1], "each text its own length"
    assert denoiser.encode_cached(engine.load(MODEL), spec, replace(p, guidance_scale=1.0)).negative_embeds is None


def test_previews_see_the_latents_the_vae_decodes(engine: SamplerEngine) -> None:
    p = params(41, images=2)
    seen: list[torch.Tensor] = []
    m = member(p, preview_at=frozenset({2}), on_preview=lambda step, total, latents: seen.append(latents))
    [result] = engine.sample_batch([m])
    [latents] = seen
    assert latents.shape == tensor(result).shape
    images = previews(latents, engine.registry.get(MODEL).family, p.width, p.height)
    assert len(images) == 2 and all(image.startswith(b"\xff\xd8") for image in images)


def test_the_decoder_makes_the_pipelines_image_and_encodes_one_back(
    engine: SamplerEngine, pipe: Any, models_dir: Path
) -> None:
    p = params(61, images=2)
    latents = solo(engine, p)
    decoder = VaeDecoderEngine(ModelRegistry.load(), models_dir, CPU)
    images = decoder.decode(MODEL, latents)
    expected = pipe.vae.decode(
        latents.unsqueeze(2) / (1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1))
        + torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
    ).sample[:, :, 0]
    unit = (expected / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
    for image, want in zip(images, unit, strict=True):
        assert image.shape == (p.height, p.width, 3)
        assert np.array_equal(image, (want * 255).round().to(torch.uint8).numpy())
    buffer = io.BytesIO()
    Image.fromarray(images[0]).save(buffer, format="PNG")
    encoded = decoder.encode_image(MODEL, buffer.getvalue(), p.width, p.height)
    assert encoded.shape == (1, 16, p.height // 8, p.width // 8) and bool(torch.isfinite(encoded).all())
