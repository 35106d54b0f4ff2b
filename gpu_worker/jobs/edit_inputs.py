"""An edit's or upscale's input image as its model takes it, made before the batch
runs (on the event loop's side: the encode is a call to a decoder service): an
edit's input encoded into latents by its model's VAE and its mask brought to the
latents' size, as diffusers' pipelines do; an upscale's input as pixels. A model
whose text encoder sees the input (Qwen-Image-Edit's) takes it resized to its
condition size, as pixels for the encoder and as latents beside the denoised ones.
Each stored input is first checked as the gateway checks it now (an image whose
sides or aspect its model's bounds refuse: a job stored before they were): a job's
own bad input fails it alone, as its own fault (InvalidArgument), never its worker's.
A job of a model whose text encoders are the decoder service's (``text_encoders =
"service"``) gets its conditioning from a decoder here too, with or without an image:
joiners of a running batch are prepared the same way."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from gpu_worker.decoding.decoders import Decoders
from gpu_worker.decoding.prompt_encoders import served_conditioning
from gpu_worker.denoising.members import MemberInputs
from gpu_worker.denoising.prompts import Conditioning
from gpu_worker.jobs.job_store import JobStore
from services.db.records import JobRecord
from services.errors import FieldViolation, InvalidArgument
from services.generation import GenerationParams, JobInputs, Task
from services.models.input_limits import edit_condition_size, image_violations
from services.models.registry import ModelRegistry
from services.models.spec import ModelSpec
from services.models.vae import pixels_of

# The VAE's spatial compression of the editing families (SD's): the mask's scale.
LATENT_SCALE = 8


def _never_guided(params: GenerationParams) -> bool:
    return False


class EditInputs:
    def __init__(
        self,
        store: JobStore,
        decoders: Decoders,
        registry: ModelRegistry,
        guided: Callable[[GenerationParams], bool] = _never_guided,
    ) -> None:
        self.store = store
        self.decoders = decoders
        self.registry = registry
        self.guided = guided  # whether a job's conditioning has its negative half (its family's say)

    def _served(self, job: JobRecord) -> bool:
        spec = self.registry.models.get(job.params.model)
        return spec is not None and spec.text_encoders == "service"

    async def prepare(self, jobs: Sequence[JobRecord]) -> dict[str, MemberInputs | BaseException]:
        """Per job that has an input image, or whose conditioning a decoder encodes,
        by id: its inputs, or what kept it from having them (the database's absence
        keeps them all: a job without an image would otherwise run unconditioned)."""
        with_images = [job for job in jobs if job.params.image_digest]
        wanted = [job for job in jobs if job.params.image_digest or self._served(job)]
        if not wanted:
            return {}
        try:
            stored = await self.store.inputs(with_images) if with_images else {}
        except Exception as exc:  # the database stayed away: every job here waits for redelivery
            return {job.id: exc for job in wanted}
        out: dict[str, MemberInputs | BaseException] = {}
        for job in wanted:
            found = stored.get(job.id)
            try:
                inputs = MemberInputs()
                if job.params.image_digest:
                    if found is None:
                        # Inputs are stored with their job: none ever will be.
                        raise InvalidArgument([FieldViolation("image", "is not stored for this job")])
                    inputs = await self._prepare(job, found)
                if self._served(job):
                    inputs = replace(inputs, conditioning=await self._conditioning(job, inputs, found))
                out[job.id] = inputs
            except Exception as exc:
                out[job.id] = exc
        return out

    async def _conditioning(self, job: JobRecord, inputs: MemberInputs, stored: JobInputs | None) -> Conditioning:
        """The job's conditioning from a decoder: with the input image where its text encoder sees it."""
        image, size = b"", (0, 0)
        if inputs.prompt_image is not None and stored is not None:
            image, size = stored.image, (int(inputs.prompt_image.shape[-1]), int(inputs.prompt_image.shape[-2]))
        return await served_conditioning(self.decoders, job, self.guided(job.params), image, size)

    async def _prepare(self, job: JobRecord, inputs: JobInputs) -> MemberInputs:
        p = job.params
        spec = self.registry.models.get(p.model)
        if spec is not None:
            check_stored(spec, inputs)
        if job.task == Task.UPSCALE:
            return MemberInputs(image=await asyncio.to_thread(image_tensor, inputs.image))
        if spec is not None and spec.prompt_sees_image:
            seen = await asyncio.to_thread(condition_image, inputs.image)
            height, width = seen.shape[-2:]
            return MemberInputs(
                image_latents=await self.decoders.encode(job, inputs.image, width, height), prompt_image=seen
            )
        latents = await self.decoders.encode(job, inputs.image, p.width, p.height)
        mask = None
        if inputs.mask is not None:
            mask = await asyncio.to_thread(mask_tensor, inputs.mask, p.width, p.height)
        return MemberInputs(image_latents=latents, mask=mask)


def check_stored(spec: ModelSpec, inputs: JobInputs) -> None:
    """InvalidArgument naming the stored image or mask that is no image, or whose
    sides or aspect its model's bounds refuse. Reads their headers alone: what is
    stored was decoded whole by the gateway."""
    bad = []
    for field, data in (("image", inputs.image), ("mask", inputs.mask)):
        if data is None:
            continue
        try:
            with Image.open(io.BytesIO(data)) as opened:
                width, height = opened.size
        except Exception as exc:  # Pillow raises many kinds for bad bytes
            bad.append(FieldViolation(field, f"cannot be read: {exc}"))
            continue
        bad += image_violations(field, width, height, spec)
    if bad:
        raise InvalidArgument(bad)


def image_tensor(data: bytes) -> torch.Tensor:
    """An image as (1, 3, h, w) float32 in [-1, 1]."""
    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    return torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0) / 127.5 - 1.0


def condition_image(data: bytes) -> torch.Tensor:
    """An input image as a text encoder that sees it takes it: resized to its
    condition size (Lanczos, as the decoder resizes it for its latents), (1, 3, h, w) uint8."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = edit_condition_size(*image.size)
    return torch.tensor(pixels_of(data, width, height)).permute(2, 0, 1).unsqueeze(0)


def mask_tensor(data: bytes, width: int, height: int) -> torch.Tensor:
    """A mask as diffusers' inpainting pipelines make it: grey, resized to the
    output's size, 1 where it is at least half white, then brought to the latents'
    size by nearest neighbour: (1, 1, height/8, width/8) float32."""
    with Image.open(io.BytesIO(data)) as image:
        grey = image.convert("L")
    if grey.size != (width, height):
        grey = grey.resize((width, height), Image.Resampling.LANCZOS)
    mask = torch.from_numpy(np.asarray(grey, dtype=np.float32) / 255.0)[None, None]
    mask = (mask >= 0.5).float()
    return torch.nn.functional.interpolate(mask, size=(height // LATENT_SCALE, width // LATENT_SCALE))
