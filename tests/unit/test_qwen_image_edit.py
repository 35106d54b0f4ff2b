"""Qwen-Image-Edit's instruction edits in the sampler's loop, on the CPU with its
miniature: an edit of an image given as the sampler gets it (its pixels at the
condition size, for the text encoder, and the decoder's VAE latents of them) is
exactly ``QwenImageEditPipeline``'s of the same image, guided or not; in a batch of
edits of other images, prompts, steps and guidance, each gets its solo latents; a
suspended edit resumes in another engine to its uninterrupted latents; a job
without an input image fails alone, as its own fault, naming what it lacks; the
conditioning is cached under the image's digest, since the text encoder sees the
image; compiled, a prompt too long for the compiled text fails no batch."""

from __future__ import annotations

import io
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline
from PIL import Image

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberInputs
from gpu_worker.denoising.prompts import text_length
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.edit_inputs import condition_image
from gpu_worker.jobs.failures import classify
from services.errors import InvalidArgument
from services.generation import GenerationParams
from services.models.input_limits import edit_condition_size
from services.models.prompt_encoding import QWEN_EDIT_TEXT_LEN
from services.models.qwen_processor import load_processor
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from tests.unit.test_flow_families import tensor
from tests.unit.test_speed_options import TOLERANCE, Compilations, compilations

__all__ = ["compilations"]  # the fixture, shared with test_speed_options

MODEL = "tiny-qwen-image-edit"
CPU = torch.device("cpu")
WIDTH, HEIGHT = 64, 96


def params(seed: int, steps: int = 3, guidance: float = 4.0, images: int = 1, prompt: str = "") -> GenerationParams:
    text = prompt or f"make it night {seed}"
    return GenerationParams(MODEL, text, "", WIDTH, HEIGHT, steps, guidance, seed, images, image_digest=f"image-{seed}")


def png(seed: int, width: int = WIDTH, height: int = HEIGHT) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image(seed: int) -> MemberInputs:
    """An input image as the sampler gets one, its latents random: (1, 16, h/8, w/8)
    at the condition size of a WIDTH x HEIGHT input."""
    width, height = edit_condition_size(WIDTH, HEIGHT)
    latents = torch.randn(1, 16, height // 8, width // 8, generator=torch.Generator().manual_seed(seed))
    return MemberInputs(image_latents=latents, prompt_image=condition_image(png(seed)))


def image_shape(inputs: MemberInputs) -> torch.Size:
    assert inputs.image_latents is not None
    return inputs.image_latents.shape


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


@pytest.mark.parametrize("guidance", [4.0, 1.0], ids=["true-cfg", "unguided"])
def test_an_edit_gets_exactly_its_pipelines_latents(engine: SamplerEngine, models_dir: Path, guidance: float) -> None:
    """The sampler's inputs made as the worker makes them: the pixels by
    ``condition_image`` and the latents by the decoder's VAE (its mode, as the
    pipeline's ``sample_mode="argmax"``); the pipeline given the same picture."""
    p, data = params(3, guidance=guidance, images=2), png(3)
    seen = condition_image(data)
    height, width = seen.shape[-2:]
    decoder = VaeDecoderEngine(ModelRegistry.load(), models_dir, CPU)
    latents = decoder.encode_image(MODEL, data, width, height)
    inputs = MemberInputs(image_latents=latents, prompt_image=seen)
    path = models_dir / MODEL
    pipe: Any = QwenImageEditPipeline.from_pretrained(path, processor=load_processor(path / "processor"))
    pipe.set_progress_bar_config(disable=True)
    picture = Image.fromarray(seen[0].permute(1, 2, 0).numpy())
    # Its own encoding of the picture, normalised as it normalises it: the decoder's
    # bar the rounding of [0, 255] to [-1, 1] (x / 127.5 - 1 there, x / 255 * 2 - 1 here).
    own = pipe._encode_vae_image(pipe.image_processor.preprocess(picture, height, width).unsqueeze(2), None)
    torch.testing.assert_close(own[:, :, 0], latents, rtol=0, atol=1e-5)
    pipe._encode_vae_image = lambda image, generator: latents.unsqueeze(2)
    expected = pipe(
        image=picture,
        prompt=p.prompt,
        negative_prompt=" " if guidance > 1.0 else None,
        true_cfg_scale=guidance,
        height=p.height,
        width=p.width,
        num_inference_steps=p.steps,
        generator=[torch.Generator().manual_seed(3 + i) for i in range(2)],
        num_images_per_prompt=2,
        output_type="latent",
    ).images
    expected = pipe._unpack_latents(expected, p.height, p.width, pipe.vae_scale_factor)[:, :, 0]
    assert torch.equal(solo(engine, p, inputs), expected)


def test_the_image_reaches_the_encoder_and_the_network(engine: SamplerEngine) -> None:
    p, inputs = params(4), image(4)
    edited = solo(engine, p, inputs)
    other = image(5)
    seen_only = replace(inputs, prompt_image=other.prompt_image)
    assert not torch.equal(solo(engine, replace(p, image_digest="image-5"), seen_only), edited), "the encoder sees it"
    latents_only = replace(inputs, image_latents=other.image_latents)
    assert not torch.equal(solo(engine, p, latents_only), edited), "the network sees its tokens"


def test_the_conditioning_is_cached_under_the_images_digest(engine: SamplerEngine) -> None:
    spec = engine.registry.get(MODEL)
    pipe, denoiser = engine.load(MODEL), engine.denoiser_for(spec)
    p = params(6)
    first = denoiser.encode_cached(pipe, spec, p, image(6))  # type: ignore[attr-defined]
    assert denoiser.encode_cached(pipe, spec, p, image(6)) is first  # type: ignore[attr-defined]
    other = denoiser.encode_cached(pipe, spec, replace(p, image_digest="image-7"), image(7))  # type: ignore[attr-defined]
    assert other is not first and not torch.equal(other.embeds, first.embeds)


def test_edits_of_other_images_prompts_steps_and_guidance_each_get_their_solo_latents(engine: SamplerEngine) -> None:
    jobs = [
        (params(1), image(1)),
        (params(2, steps=4, guidance=1.0, prompt="a red door, please"), image(2)),
        (params(3, images=2, guidance=6.0), image(3)),
    ]
    results = engine.sample_batch([member(p, i) for p, i in jobs])
    for (p, inputs), result in zip(jobs, results, strict=True):
        assert torch.equal(tensor(result), solo(engine, p, inputs))


def test_a_suspended_edit_resumes_in_another_engine_to_its_uninterrupted_latents(models_dir: Path) -> None:
    p, inputs = params(9, steps=5), image(9)
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 2:
            stop.set()

    [result] = new_engine(models_dir).sample_batch(
        [member(p, inputs, on_step=on_step, stopping=stop, suspend=lambda: True)]
    )
    assert isinstance(result, JobSuspended) and result.checkpoint.step == 2
    # The image's latents come back from the checkpoint; its pixels, as the worker
    # makes them again for a resumed job, are re-encoded with the prompt.
    resumed_inputs = replace(inputs, image_latents=torch.zeros(image_shape(inputs)))
    [resumed] = new_engine(models_dir).sample_batch([member(p, resumed_inputs, resume=result.checkpoint)])
    assert torch.equal(tensor(resumed), solo(new_engine(models_dir), p, inputs))


def test_a_job_without_an_input_image_fails_alone_naming_it(engine: SamplerEngine) -> None:
    results = engine.sample_batch([member(replace(params(1), image_digest=""), None), member(params(2), image(2))])
    # The job's own fault: never retried, and no sign that the worker is unfit.
    assert isinstance(results[0], InvalidArgument) and [v.field for v in results[0].violations] == ["image"]
    assert not classify(results[0]).retryable and not classify(results[0]).blames_worker
    assert torch.equal(tensor(results[1]), solo(engine, params(2), image(2)))


def test_a_prompt_past_the_compiled_text_length_fails_no_batch(models_dir: Path, compilations: Compilations) -> None:
    """Compiled, as on an accelerator: the members and both halves of their guided
    steps in one call, every text padded to the compiled length (the miniature's
    2,048 tokens, its tokenizer's). A prompt whose text with the image passes it (one
    the gateway refuses, stored before it did) is cut to it as it is encoded: both
    members get their images, the other one its own."""
    spec = replace(
        ModelRegistry.load().get(MODEL), compile=True, max_batch=2, default_width=WIDTH, default_height=HEIGHT
    )
    compiled = SamplerEngine(ModelRegistry({MODEL: spec}), models_dir, CPU)
    denoiser = compiled.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    denoiser.fuse_batches = denoiser.halves_share_call = True
    pipe = compiled.load(MODEL)
    long, short = params(11, prompt="make it night, " * 150), params(12)  # 2,250 bytes: 2,533 tokens with the image
    assert len(long.prompt.encode()) > 2048
    embeds = denoiser.encode_cached(pipe, spec, long, image(11)).embeds
    assert embeds is not None and embeds.shape[1] == 2048 == text_length(pipe.tokenizer, QWEN_EDIT_TEXT_LEN)
    results = compiled.sample_batch([member(long, image(11)), member(short, image(12))])
    assert isinstance(results[0], torch.Tensor) and bool(torch.isfinite(results[0]).all())
    alone = new_engine(models_dir)
    torch.testing.assert_close(tensor(results[1]), solo(alone, short, image(12)), rtol=0, atol=TOLERANCE)
