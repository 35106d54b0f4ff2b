"""The denoising loop never waits for the host between steps: run on the meta device
(tensors with shapes and no data), where whatever would make a CUDA device empty its
queue for the host fails: reading a device value (``.item()``, ``bool()``, an index
into a host table, ``nonzero``), a copy back to the host, or mixing host tables with
device tensors (a device mismatch on CUDA). The miniatures' real networks run, with
each noise scheduler their families use, guidance, a fused batch of members of
different sizes and one of other steps and guidance, an edit and an inpainting member,
texts of other lengths padded and masked (Qwen-Image)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_worker.denoising.checkpoint_capture import CheckpointPolicy, MemberCheckpoints
from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.members import BatchMember, MemberInputs
from gpu_worker.denoising.prompts import Conditioning, prompt_key
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.input_limits import edit_condition_size
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily, ModelSpec

META = torch.device("meta")
STEPS = 6


class HostToDevice(TorchDispatchMode):
    """Counts copies from the host onto the device: on CUDA each one (from pageable
    memory) waits for the device's queue."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = kwargs.get("device") or args[0].device
            if source.device.type == "cpu" and torch.device(target).type == "meta" and source.dim() > 0:
                self.copies += 1
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    registry = ModelRegistry.load()
    # Z-Image with its guided predictions' norms capped: a choice made on the device.
    capped = replace(registry.get("tiny-z-image"), name="tiny-z-image-capped", cfg_normalization=1.0)
    # Z-Image's prompts encoded on the host for real: each row's length stays there.
    host = replace(registry.get("tiny-z-image"), name="tiny-z-image-host-encoder", text_encoders="host")
    variants = {spec.name: spec for spec in (capped, host)}
    return SamplerEngine(ModelRegistry({**registry.models, **variants}), models_dir, META)


def _encoded(
    denoiser: DiffusersDenoiser, pipe: Any, spec: ModelSpec, params: GenerationParams, inputs: MemberInputs | None
) -> Conditioning:
    """The prompt's conditioning as the cache would hold it: encoding a prompt happens
    once per prompt, before the loop (and a text encoder may read back its lengths)."""
    try:
        return denoiser.encode_cached(pipe, spec, params, inputs)
    except (RuntimeError, NotImplementedError):
        # Wan's UMT5 trims each prompt to its length, Qwen-Image's Qwen2.5-VL drops
        # its padding, and Z-Image keeps each prompt's own tokens, read off the device:
        # shapes only, as the cache would hand them over (a negative text shorter
        # than its prompt, as texts differ).
        cfg = denoiser.classifier_free(params)
        dtype = pipe.transformer.dtype
        config = pipe.text_encoder.config
        if spec.family == ModelFamily.Z_IMAGE:
            # Each row's length on the host: the network cuts its text to it.
            lengths = (31, 26)
            embeds = torch.zeros(1, lengths[0], config.hidden_size, device=META, dtype=dtype)
            conditioning = Conditioning(
                embeds,
                embeds[:, : lengths[1]] if cfg else None,
                text_lengths=torch.tensor(lengths[:1]),
                negative_text_lengths=torch.tensor(lengths[1:]) if cfg else None,
            )
        else:
            qwen = spec.family in (ModelFamily.QWEN_IMAGE, ModelFamily.QWEN_IMAGE_EDIT)
            hidden = config.text_config.hidden_size if qwen else config.d_model
            embeds = torch.zeros(1, 512, hidden, device=META, dtype=dtype)
            negative = embeds[:, : 7 + params.seed] if qwen else embeds.clone()
            conditioning = Conditioning(embeds, negative if cfg else None)
        # Qwen-Image-Edit's conditioning is its prompt's and its input image's.
        key = (*prompt_key(params, cfg), params.image_digest) if spec.prompt_sees_image else prompt_key(params, cfg)
        return denoiser.prompts.get(key, lambda: conditioning)


CASES = {
    # model, scheduler (the model's own when empty), guidance
    "sd-pndm": ("tiny", "PNDMScheduler", 7.5),
    "sd-euler": ("tiny", "", 7.5),
    "sd-euler-ancestral": ("tiny", "EulerAncestralDiscreteScheduler", 7.5),
    "sd-dpm-multistep": ("tiny", "DPMSolverMultistepScheduler", 7.5),
    "sd-ddim-no-guidance": ("tiny", "DDIMScheduler", 1.0),
    "sd-unipc": ("tiny", "UniPCMultistepScheduler", 5.0),
    "wan": ("tiny-wan", "", 5.0),
    "wan22-two-experts": ("tiny-wan22", "", 5.0),  # members on both sides of the boundary in a step
    "sd3": ("tiny-sd3", "", 4.5),
    "flux-dev": ("tiny-flux", "", 3.5),
    "flux-schnell": ("tiny-flux-schnell", "", 1.0),
    "flux-kontext": ("tiny-flux-kontext", "", 2.5),
    "qwen-image": ("tiny-qwen-image", "", 4.0),
    "z-image-turbo": ("tiny-z-image", "", 0.0),  # the third member guided (a scale of 1)
    "z-image-capped": ("tiny-z-image-capped", "", 4.0),
    "z-image-host-encoder": ("tiny-z-image-host-encoder", "", 4.0),
    "qwen-image-edit": ("tiny-qwen-image-edit", "", 4.0),
    "upscaler": ("tiny-upscaler", "", 7.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_loop_never_reads_the_device_back(engine: SamplerEngine, case: str) -> None:
    model, scheduler, guidance = CASES[case]
    spec = engine.registry.get(model)
    if scheduler:
        spec = replace(spec, scheduler=scheduler)
    denoiser = engine.denoiser_for(spec)
    assert isinstance(denoiser, DiffusersDenoiser)
    pipe = engine.load(model)
    assert denoiser.network(pipe).device.type == "meta"
    size = spec.default_width

    def params(
        seed: int, images: int = 1, steps: int = STEPS, scale: float = guidance, **extra: Any
    ) -> GenerationParams:
        return GenerationParams(model, "a lighthouse", "", size, size, steps, scale, seed, images, **extra)

    # The third, of other steps and guidance, shares each call at its own timestep
    # and guidance scale (as a job that joined the batch would).
    requests = [params(1), params(2, images=2), params(5, steps=STEPS + 2, scale=guidance + 1.5 if guidance > 1 else 1)]
    inputs: list[MemberInputs | None] = [None, None, None]
    if spec.upscales:
        image = torch.zeros(1, 3, size // 4, size // 4, device=META)
        inputs = [MemberInputs(image=image)] * 3
    elif spec.prompt_sees_image:
        # The input at its condition size: latents beside the denoised ones, pixels for the text encoder.
        width, height = edit_condition_size(size, size)
        image_latents = torch.zeros(1, 16, height // 8, width // 8, device=META)
        pixels = torch.zeros(1, 3, height, width, dtype=torch.uint8)
        inputs = [MemberInputs(image_latents=image_latents, prompt_image=pixels)] * 3
    elif spec.instruction_edits:
        inputs = [MemberInputs(image_latents=torch.zeros(1, 16, size // 8, size // 8, device=META))] * 3
    elif spec.edits:
        channels = 4 if spec.family in (ModelFamily.SD15, ModelFamily.SDXL, ModelFamily.TINY) else 16
        image_latents = torch.zeros(1, channels, size // 8, size // 8, device=META)
        mask = torch.ones(1, 1, size // 8, size // 8, device=META)
        requests += [params(3, strength=0.5), params(4, strength=1.0)]
        inputs += [MemberInputs(image_latents=image_latents), MemberInputs(image_latents=image_latents, mask=mask)]
    for p, given in zip(requests, inputs, strict=True):
        _encoded(denoiser, pipe, spec, p, given)

    seen: list[tuple[int, int]] = []
    copies: list[int] = []
    counter = HostToDevice()

    def on_step(i: int) -> Any:
        def stepped(step: int, total: int) -> None:
            seen.append((i, step))
            copies.append(counter.copies)

        return stepped

    members = [BatchMember(p, on_step(i), threading.Event(), inputs=inputs[i]) for i, p in enumerate(requests)]
    with counter:
        runs = denoiser.denoise(pipe, spec, members, MemberCheckpoints(META, CheckpointPolicy()))
    assert [r.result for r in runs] == [None] * len(runs), "every member ran to its end"
    for r in runs:
        assert r.state is not None and r.state.latents.device == META
        assert r.step == r.total
    assert {i for i, _ in seen} == set(range(len(members)))
    # Whatever the first step copies onto the device (none so far), no later one does.
    first_round = len(members)
    assert copies[first_round - 1 :] == [copies[first_round - 1]] * (len(copies) - first_round + 1)
