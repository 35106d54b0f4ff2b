"""The bare diffusers loop ``bench/gpu.py`` measures the stack against: one process
calling the family's pipeline (SD 1.5, SDXL, SD 3.5, Flux.1), with the same speed
options, guidance and prompt length the sampler uses, and the VAE decode the
decoder service does."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.models import image_vae, speed
from services.models.sources import resolve_source
from services.models.spec import ModelFamily, ModelSpec

PROMPT = "a lighthouse on a cliff at dusk, oil painting"
EDIT_PROMPT = "make it night, with the lighthouse lit"


def edit_input(size: int) -> bytes:
    """An edit case's input image: a PNG of ``size`` x ``size``, the same every run."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# Flux.1's T5 prompt length as the sampler encodes it: dev's 512, schnell's 256.
FLUX_TEXT_LEN = {True: 512, False: 256}


@dataclass(frozen=True)
class Case:
    name: str  # what --cases calls it
    model: str
    size: int
    steps: int
    jobs: int  # saturated mode's jobs
    edit: bool = False  # each job edits an input image (EDIT_INPUT, at the case's size) by its prompt


@dataclass(frozen=True)
class Bare:
    images_per_s: float
    peak_bytes: int
    decode_s_per_image: float  # the VAE on the sampler's device
    ship_s_per_image: float  # serializing latents for the decoder service
    latents: torch.Tensor  # the first round's, for an option's drift


class OwnedOutputs:
    """A compiled network as the pipeline calls it: a CUDA-graph step marked before
    each call, and its output copied out of the graph's memory (the pipeline's
    multistep schedulers keep earlier outputs)."""

    def __init__(self, network: Any, options: speed.SpeedOptions) -> None:
        self._network = network
        self._options = options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._network, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with speed.network_call(self._options):
            out = self._network(*args, **kwargs)
        return (speed.owned(out[0], self._options), *out[1:]) if isinstance(out, tuple) else out


def bare_pipeline(spec: ModelSpec, device: torch.device, models: Path) -> Any:
    from diffusers import DiffusionPipeline

    source, kwargs = resolve_source(spec, models)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    extra = {"safety_checker": None, "requires_safety_checker": False} if spec.family == ModelFamily.SD15 else {}
    pipe = DiffusionPipeline.from_pretrained(source, torch_dtype=dtype, **kwargs, **extra).to(device)
    if spec.family == ModelFamily.FLUX_KONTEXT:
        from diffusers import FluxKontextPipeline

        pipe = FluxKontextPipeline(**pipe.components)  # a Kontext entry may serve dev-shaped weights
    pipe.set_progress_bar_config(disable=True)
    options = speed.SpeedOptions.of(spec, device)
    if options.any:
        if getattr(pipe, "unet", None) is not None:
            pipe.unet = OwnedOutputs(speed.prepare_unet(pipe.unet, options), options)
        else:
            pipe.transformer = OwnedOutputs(speed.prepare(pipe.transformer, options), options)
        if spec.family != ModelFamily.QWEN_IMAGE:  # its 3D VAE takes none, as in the decoder service
            speed.prepare_vae(pipe.vae, options)
    return pipe


def bare_loop(
    spec: ModelSpec, case: Case, batches: Sequence[int], device: torch.device, rounds: int, models: Path
) -> dict[int, Bare]:
    from gpu_worker.decoding.decoders import decode_request

    pipe = bare_pipeline(spec, device, models)
    results = {}
    for batch in batches:
        _sample(pipe, spec, case, batch, 0, device)  # warm-up: kernels, allocator, a compilation
        _decode(pipe, _sample(pipe, spec, case, batch, 0, device))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        started = time.perf_counter()
        decode_s = ship_s = 0.0
        first: torch.Tensor | None = None
        for r in range(rounds):
            latents = _sample(pipe, spec, case, batch, 1000 * (r + 1), device)
            _sync(device)
            t0 = time.perf_counter()
            _decode(pipe, latents)
            _sync(device)
            t1 = time.perf_counter()
            decode_request([(_job(case, batch), latents)], [None])
            t2 = time.perf_counter()
            decode_s += t1 - t0
            ship_s += t2 - t1
            first = latents.float().cpu() if first is None else first
        took = time.perf_counter() - started - ship_s
        images = batch * rounds
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        assert first is not None
        results[batch] = Bare(images / took, peak, decode_s / images, ship_s / images, first)
    del pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample(pipe: Any, spec: ModelSpec, case: Case, batch: int, seed: int, device: torch.device) -> torch.Tensor:
    """A batch's latents as the decoder takes them (Flux's unpacked), made as the
    sampler makes them: the model's default guidance, its family's prompt length."""
    generators = [torch.Generator(device).manual_seed(seed + i) for i in range(batch)]
    extra: dict[str, Any] = {}
    flux = spec.family in (ModelFamily.FLUX, ModelFamily.FLUX_KONTEXT)
    if flux:
        extra["max_sequence_length"] = FLUX_TEXT_LEN[bool(pipe.transformer.config.guidance_embeds)]
    if spec.family == ModelFamily.QWEN_IMAGE:
        # True classifier-free guidance, its negative a space where a job gives none, as the sampler's.
        extra.update(true_cfg_scale=spec.default_guidance, negative_prompt=[" "] * batch, guidance_scale=None)
    if case.edit:
        import io

        from PIL import Image

        extra["image"] = Image.open(io.BytesIO(edit_input(case.size))).convert("RGB")
        extra.update(_auto_resize=False, max_area=case.size * case.size)  # the job's own size, as the stack's
    with torch.inference_mode():
        latents = pipe(
            prompt=[EDIT_PROMPT if case.edit else PROMPT] * batch,
            width=case.size,
            height=case.size,
            num_inference_steps=case.steps,
            generator=generators,
            output_type="latent",
            **{"guidance_scale": spec.default_guidance, **extra},
        ).images
    if flux or spec.family == ModelFamily.QWEN_IMAGE:
        latents = pipe._unpack_latents(latents, case.size, case.size, pipe.vae_scale_factor)
    return latents[:, :, 0] if latents.dim() == 5 else latents  # Qwen-Image's frame axis


def _decode(pipe: Any, latents: torch.Tensor) -> None:
    config = pipe.vae.config
    if type(pipe.vae).__name__ == "AutoencoderKLQwenImage":  # normalised per channel, a frame axis
        with torch.inference_mode():
            pipe.vae.decode(image_vae.vae_input(pipe.vae, latents.to(pipe.vae.dtype))).sample.float().cpu()
        return
    z = latents / config.scaling_factor + (getattr(config, "shift_factor", None) or 0.0)
    with torch.inference_mode():
        pipe.vae.decode(z.to(pipe.vae.dtype)).sample.float().cpu()


def _job(case: Case, batch: int) -> Any:
    """A JobRecord as ``decode_request`` reads one: its id, model, output format, images,
    fps, and output policy (building the request costs the same whatever the policy)."""
    from types import SimpleNamespace

    params = SimpleNamespace(model=case.model, num_images=batch, fps=0.0)
    return SimpleNamespace(id="bench", output_format="png", output_policy="", params=params)
