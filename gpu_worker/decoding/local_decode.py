"""A sampler decoding its own latents, on its own device: where no decoder service
could (``local_decode_fallback``), or always (``decode_locally``: a box whose decoder
would share its GPU), and an edit's input image into latents the same way. A batch
decodes in one VAE call, on a CUDA stream of the lowest priority (denoising runs on
one of the highest), then each image is checked by the image filter as the decoder
service checks it (``services.safety``: one classifier call for the batch) and
encoded as its verdict has it."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from services.db.records import ImageRecord, JobRecord
from services.errors import DegenerateOutput
from services.models.encoding import encode_output, mime_type_of
from services.models.vae import VaeDecoderEngine
from services.safety.image_filter import NO_FILTER, ImageFilter, ImageFilterUnavailable, check_outputs
from services.safety.verdicts import Judged

# What each job of a decode came to: its images, or why it has none.
Decoded = dict[str, list[ImageRecord] | BaseException]


@dataclass(frozen=True)
class LocalDecoder:
    engine: VaeDecoderEngine
    # None: the image filter is off here, and a job whose outputs are to be checked
    # fails rather than have them returned unchecked.
    image_filter: ImageFilter | None = field(default=None)

    def decode_batch(self, jobs: Sequence[tuple[JobRecord, torch.Tensor]]) -> Decoded:
        """The batch's latents in one VAE call on this device (a lower-priority stream
        than the denoising's), then each image checked and encoded; a job whose
        images cannot be made (or checked) fails alone."""
        model = jobs[0][0].params.model
        stream = self.engine.decode_stream()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                decoded = self.engine.decode_images(model, torch.cat([latents for _, latents in jobs]))
            except Exception as exc:
                return {job.id: exc for job, _ in jobs}
        out: Decoded = {}
        fine: list[tuple[JobRecord, list[np.ndarray]]] = []
        start = 0
        for job, latents in jobs:
            own = decoded[start : start + len(latents)]
            start += len(latents)
            faults = [f"image {i}: {image.fault}" for i, image in enumerate(own) if image.fault]
            if faults:
                out[job.id] = DegenerateOutput("; ".join(faults))
            elif job.output_policy and self.image_filter is None:
                out[job.id] = ImageFilterUnavailable(NO_FILTER)
            else:
                fine.append((job, [image.pixels for image in own]))
        try:
            # The batch's outputs scored together, as a decoder service scores its batch.
            pixels = [p for _, own_pixels in fine for p in own_pixels]
            verdicts = check_outputs(self.image_filter, pixels, [j.output_policy for j, own in fine for _ in own])
        except Exception as exc:
            return {**out, **{job.id: exc for job, _ in fine}}
        start = 0
        for job, own_pixels in fine:
            judged = verdicts[start : start + len(own_pixels)]
            start += len(own_pixels)
            try:
                out[job.id] = [_record(job, i, p, j) for i, (p, j) in enumerate(zip(own_pixels, judged, strict=True))]
            except Exception as exc:
                out[job.id] = exc
        return out

    def decode_job(self, job: JobRecord, latents: torch.Tensor) -> list[ImageRecord]:
        """One job's images; raises what kept it from having them."""
        pixels = self.engine.decode(job.params.model, latents.detach().to("cpu", torch.float32))
        judged = check_outputs(self.image_filter, pixels, [job.output_policy] * len(pixels))
        return [_record(job, i, p, j) for i, (p, j) in enumerate(zip(pixels, judged, strict=True))]

    def encode(self, job: JobRecord, image: bytes, width: int, height: int) -> torch.Tensor:
        """An edit's input image resized to ``width`` x ``height`` as its model's latents (1, C, height/8, width/8)."""
        return self.engine.encode_image(job.params.model, image, width, height)


def _record(job: JobRecord, index: int, made: np.ndarray, judged: Judged) -> ImageRecord:
    """An output as stored: its size as ``made``, encoded as its verdict has it (a
    blocked one: no bytes)."""
    mime_type = mime_type_of(job.output_format)
    data = encode_output(judged.pixels, mime_type, job.params.fps) if judged.pixels is not None else b""
    height, width = made.shape[-3:-1]
    seed = (job.params.seed + index) % 2**63
    return ImageRecord(index, data, mime_type, width, height, seed, judged.nsfw_score, judged.verdict)
