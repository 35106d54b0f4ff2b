"""Edits in the sampler's loop, on the CPU with the tiny model: image to image is
diffusers' own pipeline's latents; inpainting keeps the input outside its mask
exactly; an edit batched, or suspended and resumed, gets exactly its solo latents."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionImg2ImgPipeline

from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberInputs
from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.edit_inputs import mask_tensor
from services.generation import GenerationParams
from services.models.registry import ModelRegistry

LATENTS = torch.Generator().manual_seed(0)
# An input image's latents, as the decoder's VAE would give them: (1, 4, 8, 8) for 64x64.
IMAGE = torch.randn(1, 4, 8, 8, generator=LATENTS)
OTHER = torch.randn(1, 4, 8, 8, generator=LATENTS)
MASK = torch.zeros(1, 1, 8, 8)
MASK[..., 4:] = 1.0  # repaint the right half


def edit(seed: int, strength: float, mask: bool = False, images: int = 1) -> GenerationParams:
    return GenerationParams(
        "tiny", "a door", "", 64, 64, 10, 7.5, seed, images, strength=strength, image_digest="i", mask_digest="m" * mask
    )


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))


def run(engine: SamplerEngine, params: GenerationParams, inputs: MemberInputs, steps: list[int] | None = None):
    member = BatchMember(
        params, lambda s, t: steps.append(s) if steps is not None else None, threading.Event(), inputs=inputs
    )
    [result] = engine.sample_batch([member])
    assert isinstance(result, torch.Tensor), result
    return result


def test_image_to_image_is_the_diffusers_pipelines(engine: SamplerEngine, models_dir: Path) -> None:
    steps: list[int] = []
    ours = run(engine, edit(5, 0.6), MemberInputs(image_latents=IMAGE), steps)
    assert steps == list(range(5, 11)), "it runs the last 60 % of the steps"
    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(
        models_dir / "tiny", safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        # Four channels: the pipeline takes them as latents, as the decoder's VAE gave them.
        reference = pipe(
            prompt="a door",
            image=IMAGE,
            strength=0.6,
            num_inference_steps=10,
            guidance_scale=7.5,
            generator=[torch.Generator().manual_seed(5)],
            output_type="latent",
        ).images
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    assert not torch.equal(ours, run(engine, edit(5, 0.6), MemberInputs(image_latents=OTHER)))


def test_inpainting_keeps_the_input_outside_its_mask_exactly(engine: SamplerEngine) -> None:
    for strength in (1.0, 0.7):
        out = run(engine, edit(7, strength, mask=True, images=2), MemberInputs(image_latents=IMAGE, mask=MASK))
        keep = MASK[0, 0] == 0
        for image in out:
            assert torch.equal(image[:, keep], IMAGE[0][:, keep])
            assert not torch.equal(image[:, ~keep], IMAGE[0][:, ~keep])


def test_an_edit_batched_with_other_work_gets_its_solo_latents(engine: SamplerEngine) -> None:
    jobs = [
        (edit(1, 0.5), MemberInputs(image_latents=IMAGE)),
        (edit(2, 1.0, mask=True), MemberInputs(image_latents=OTHER, mask=MASK)),
        (GenerationParams("tiny", "a door", "", 64, 64, 10, 7.5, 3, 1), None),
    ]
    alone = [engine.sample(p, lambda s, t: None, threading.Event(), i) for p, i in jobs]
    batched = engine.sample_batch([BatchMember(p, lambda s, t: None, threading.Event(), inputs=i) for p, i in jobs])
    for a, b in zip(alone, batched, strict=True):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)


def test_a_suspended_inpainting_resumes_to_its_uninterrupted_latents(engine: SamplerEngine) -> None:
    params, inputs = edit(9, 0.8, mask=True), MemberInputs(image_latents=IMAGE, mask=MASK)
    whole = run(engine, params, inputs)
    stopping = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 5:
            stopping.set()

    [suspended] = engine.sample_batch([BatchMember(params, on_step, stopping, inputs=inputs, suspend=lambda: True)])
    assert isinstance(suspended, JobSuspended) and suspended.checkpoint.step == 5
    # Resumed without its inputs: the checkpoint carries what the rest of the steps read.
    resumed = BatchMember(params, lambda s, t: None, threading.Event(), resume=suspended.checkpoint)
    [result] = engine.sample_batch([resumed])
    assert isinstance(result, torch.Tensor) and torch.equal(result, whole)


def test_a_mask_is_diffusers_mask_at_the_latents_size(tmp_path: Path) -> None:
    import io

    from PIL import Image

    image = Image.new("L", (64, 48), 0)
    image.paste(255, (32, 0, 64, 48))
    out = io.BytesIO()
    image.save(out, format="PNG")
    mask = mask_tensor(out.getvalue(), 64, 48)
    assert mask.shape == (1, 1, 6, 8)
    assert mask[..., :4].sum() == 0 and bool((mask[..., 4:] == 1).all())
