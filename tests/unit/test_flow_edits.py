"""Image to image and inpainting with the flow-matching families (SD 3.5, Flux.1,
Qwen-Image and Z-Image, whose diffusers pipelines have them), on the CPU with their miniatures: image to
image is the family's own pipeline's latents; inpainting keeps the input outside
its mask exactly; an edit batched beside other work, or suspended and resumed in
another engine, gets exactly its solo latents."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import (
    FluxImg2ImgPipeline,
    QwenImageImg2ImgPipeline,
    StableDiffusion3Img2ImgPipeline,
    ZImageImg2ImgPipeline,
)

from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberInputs, MemberResult
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.flow_tiny import TINY_TEXT_LEN
from services.models.registry import ModelRegistry

CPU = torch.device("cpu")
PIPELINES = {
    "tiny-sd3": StableDiffusion3Img2ImgPipeline,
    "tiny-flux": FluxImg2ImgPipeline,
    "tiny-qwen-image": QwenImageImg2ImgPipeline,
    "tiny-z-image": ZImageImg2ImgPipeline,
}
GUIDANCE = {"tiny-sd3": 4.5, "tiny-flux": 3.5, "tiny-qwen-image": 4.0, "tiny-z-image": 0.0}
# What each pipeline is told so that it guides and reads its prompt as the sampler does.
PIPELINE_GUIDANCE: dict[str, dict[str, Any]] = {
    "tiny-sd3": {"guidance_scale": 4.5, "max_sequence_length": TINY_TEXT_LEN},
    "tiny-flux": {"guidance_scale": 3.5, "max_sequence_length": TINY_TEXT_LEN},
    # True classifier-free guidance, its negative prompt a space where a job gives none.
    "tiny-qwen-image": {"true_cfg_scale": 4.0, "negative_prompt": " "},
    "tiny-z-image": {"guidance_scale": 0.0},
}
LATENTS = torch.Generator().manual_seed(0)
# An input image's latents, as the decoder's VAE gives them: (1, 16, 8, 8) for 64x64.
IMAGE = torch.randn(1, 16, 8, 8, generator=LATENTS)
OTHER = torch.randn(1, 16, 8, 8, generator=LATENTS)
MASK = torch.zeros(1, 1, 8, 8)
MASK[..., 4:] = 1.0  # repaint the right half


def edit(model: str, seed: int, strength: float, mask: bool = False, images: int = 1) -> GenerationParams:
    return GenerationParams(
        model, "a door", "", 64, 64, 10, GUIDANCE[model], seed, images,
        strength=strength, image_digest="i", mask_digest="m" * mask,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return SamplerEngine(ModelRegistry.load(), models_dir, CPU)


def member(params: GenerationParams, inputs: MemberInputs | None, **extra: Any) -> BatchMember:
    on_step = extra.pop("on_step", lambda step, total: None)
    return BatchMember(params, on_step, extra.pop("stopping", threading.Event()), inputs=inputs, **extra)


def tensor(result: MemberResult) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), result
    return result


def run(engine: SamplerEngine, params: GenerationParams, inputs: MemberInputs, steps: list[int] | None = None):
    on_step = (lambda s, t: steps.append(s)) if steps is not None else (lambda s, t: None)
    [result] = engine.sample_batch([member(params, inputs, on_step=on_step)])
    return tensor(result)


@pytest.mark.parametrize("model", sorted(PIPELINES))
def test_image_to_image_is_the_familys_pipelines(engine: SamplerEngine, models_dir: Path, model: str) -> None:
    steps: list[int] = []
    ours = run(engine, edit(model, 5, 0.6), MemberInputs(image_latents=IMAGE), steps)
    assert steps == list(range(5, 11)), "it runs the last 60 % of the steps"
    pipe: Any = PIPELINES[model].from_pretrained(models_dir / model)
    pipe.set_progress_bar_config(disable=True)
    if PIPELINES[model] is ZImageImg2ImgPipeline:
        # It resizes its input as pixels before it looks at the channels: hand it the latents as they are.
        pipe.image_processor.preprocess = lambda image, **_: image
    with torch.inference_mode():
        # Sixteen channels: the pipeline takes them as latents, as the decoder's VAE gave them.
        reference = pipe(
            prompt="a door",
            image=IMAGE,
            strength=0.6,
            height=64,
            width=64,
            num_inference_steps=10,
            generator=[torch.Generator().manual_seed(5)],
            output_type="latent",
            **PIPELINE_GUIDANCE[model],
        ).images
    if PIPELINES[model] in (FluxImg2ImgPipeline, QwenImageImg2ImgPipeline):
        reference = pipe._unpack_latents(reference, 64, 64, pipe.vae_scale_factor)
        reference = reference[:, :, 0] if reference.dim() == 5 else reference  # Qwen-Image's frame axis
    assert torch.equal(ours, reference)
    assert not torch.equal(ours, run(engine, edit(model, 5, 0.6), MemberInputs(image_latents=OTHER)))


@pytest.mark.parametrize("model", sorted(PIPELINES))
def test_inpainting_keeps_the_input_outside_its_mask_exactly(engine: SamplerEngine, model: str) -> None:
    for strength in (1.0, 0.7):
        inputs = MemberInputs(image_latents=IMAGE, mask=MASK)
        out = run(engine, edit(model, 7, strength, mask=True, images=2), inputs)
        keep = MASK[0, 0] == 0
        for image in out:
            assert torch.equal(image[:, keep], IMAGE[0][:, keep])
            assert not torch.equal(image[:, ~keep], IMAGE[0][:, ~keep])


@pytest.mark.parametrize("model", sorted(PIPELINES))
def test_an_edit_batched_or_resumed_gets_its_solo_latents(engine: SamplerEngine, models_dir: Path, model: str) -> None:
    inpaint, img2img = edit(model, 3, 0.8, mask=True), edit(model, 4, 0.5, images=2)
    inputs = [MemberInputs(image_latents=IMAGE, mask=MASK), MemberInputs(image_latents=OTHER)]
    text = GenerationParams(model, "a window", "", 64, 64, 6, GUIDANCE[model], 9, 1)
    batched = engine.sample_batch([member(inpaint, inputs[0]), member(img2img, inputs[1]), member(text, None)])
    assert torch.equal(tensor(batched[0]), run(engine, inpaint, inputs[0]))
    assert torch.equal(tensor(batched[1]), run(engine, img2img, inputs[1]))
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == 5:
            stop.set()

    fresh = SamplerEngine(ModelRegistry.load(), models_dir, CPU)
    [held] = fresh.sample_batch([member(inpaint, inputs[0], on_step=on_step, stopping=stop, suspend=lambda: True)])
    assert isinstance(held, JobSuspended) and held.checkpoint.step == 5
    other = SamplerEngine(ModelRegistry.load(), models_dir, CPU)
    [resumed] = other.sample_batch([member(inpaint, None, resume=held.checkpoint)])
    assert torch.equal(tensor(resumed), run(engine, inpaint, inputs[0]))
