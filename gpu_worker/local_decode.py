"""A sampler decoding its own latents, on its own device: where no decoder service
could (``local_decode_fallback``), or always (``decode_locally``: a box whose decoder
would share its GPU), and an edit's input image into latents the same way. A batch
decodes in one VAE call, on a CUDA stream of the lowest priority (denoising runs on
one of the highest), then each image is encoded."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.db.records import ImageRecord, JobRecord
from services.errors import DegenerateOutput
from services.models.encoding import encode_output, mime_type_of
from services.models.vae import VaeDecoderEngine

# What each job of a decode came to: its images, or why it has none.
Decoded = dict[str, list[ImageRecord] | BaseException]


@dataclass(frozen=True)
class LocalDecoder:
    engine: VaeDecoderEngine

    def decode_batch(self, jobs: Sequence[tuple[JobRecord, torch.Tensor]]) -> Decoded:
        """The batch's latents in one VAE call on this device (a lower-priority stream
        than the denoising's), then each image encoded; a job whose images cannot be
        made fails alone."""
        model = jobs[0][0].params.model
        stream = self.engine.decode_stream()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                decoded = self.engine.decode_images(model, torch.cat([latents for _, latents in jobs]))
            except Exception as exc:
                return {job.id: exc for job, _ in jobs}
        out: Decoded = {}
        start = 0
        for job, latents in jobs:
            own = decoded[start : start + len(latents)]
            start += len(latents)
            faults = [f"image {i}: {image.fault}" for i, image in enumerate(own) if image.fault]
            if faults:
                out[job.id] = DegenerateOutput("; ".join(faults))
                continue
            try:
                out[job.id] = [_record(job, i, image.pixels) for i, image in enumerate(own)]
            except Exception as exc:
                out[job.id] = exc
        return out

    def decode_job(self, job: JobRecord, latents: torch.Tensor) -> list[ImageRecord]:
        """One job's images; raises what kept it from having them."""
        pixels = self.engine.decode(job.params.model, latents.detach().to("cpu", torch.float32))
        return [_record(job, i, image) for i, image in enumerate(pixels)]

    def encode(self, job: JobRecord, image: bytes) -> torch.Tensor:
        """An edit's input image as its model's latents (1, C, H/8, W/8)."""
        p = job.params
        return self.engine.encode_image(p.model, image, p.width, p.height)


def _record(job: JobRecord, index: int, pixels: np.ndarray) -> ImageRecord:
    mime_type = mime_type_of(job.output_format)
    data = encode_output(pixels, mime_type, job.params.fps)
    height, width = pixels.shape[-3:-1]
    return ImageRecord(index, data, mime_type, width, height, (job.params.seed + index) % 2**63)
