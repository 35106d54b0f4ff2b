"""What a Decode or Encode request must hold, and how a Decode's outputs are
encoded: checks and the encoding order, apart from the servicer's streaming."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from services.errors import FieldViolation, InvalidArgument
from services.models.encoding import check_mime_type, encode_output
from services.models.vae import DecodedImage
from services.models.video_encoding import check_video
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2
from services.rpc.gen.darkroom.internal.v1.vae_decoder_pb2 import DecodeJob

# A request with fewer pixels than this is encoded in one go, off the event loop: a
# thread hop per small image would cost more than its encoding.
ENCODE_TOGETHER_BELOW_PIXELS = 1024 * 1024


# The largest input an Encode takes, on each side.
MAX_ENCODE_SIDE = 4096


def check_encode(request: vae_decoder_pb2.EncodeRequest) -> None:
    bad = []
    if not request.image:
        bad.append(FieldViolation("image", "is required"))
    for name in ("width", "height"):
        side = getattr(request, name)
        if not 8 <= side <= MAX_ENCODE_SIDE or side % 8:
            bad.append(FieldViolation(name, f"{side} is not a multiple of 8 within 8..{MAX_ENCODE_SIDE}"))
    if bad:
        raise InvalidArgument(bad)


def check_jobs(jobs: Sequence[DecodeJob], images: int, *, video: bool = False) -> list[tuple[DecodeJob, str]]:
    """Each job with the MIME type it is encoded in; InvalidArgument when the jobs do
    not account for the latents' images (or videos) exactly."""
    if not jobs:
        raise InvalidArgument([FieldViolation("jobs", "name at least one job")])
    if any(job.images < 1 for job in jobs) or sum(job.images for job in jobs) != images:
        raise InvalidArgument(
            [FieldViolation("jobs", f"their images ({[j.images for j in jobs]}) must add up to the {images} latents")]
        )
    if video:
        for job in jobs:
            check_video(check_mime_type(job.mime_type, video=True), 2, 2, job.fps)
    return [(job, check_mime_type(job.mime_type, video=video)) for job in jobs]


def outputs_to_check(sliced: list[tuple[int, DecodeJob, list[DecodedImage]]]) -> list[tuple[int, int]]:
    """(job, image) of each output to be checked, in order."""
    return [(index, i) for index, job, own in sliced if job.output_policy for i in range(len(own))]


async def encoded(
    sliced: list[tuple[int, DecodeJob, list[DecodedImage]]], jobs: dict[int, tuple[DecodeJob, str]]
) -> AsyncIterator[tuple[int, DecodeJob, int, DecodedImage, str, bytes]]:
    """Each image of each job encoded in its job's format, as soon as it is: small
    ones together in one thread, large ones each in its own (PIL compresses outside
    the GIL), in the order they finish."""
    todo = [(index, job, i, image, jobs[index][1]) for index, job, own in sliced for i, image in enumerate(own)]
    pixels = sum(image.pixels[..., 0].size for *_, image, _ in todo)  # a video's frames' too
    if pixels < ENCODE_TOGETHER_BELOW_PIXELS:
        datas = await asyncio.to_thread(
            lambda: [encode_output(image.pixels, mime, job.fps) for _, job, _, image, mime in todo]
        )
        for item, data in zip(todo, datas, strict=True):
            yield (*item, data)
        return

    async def one(n: int) -> tuple[int, bytes]:
        _, job, _, image, mime_type = todo[n]
        return n, await asyncio.to_thread(encode_output, image.pixels, mime_type, job.fps)

    encodings = [asyncio.ensure_future(one(n)) for n in range(len(todo))]
    try:
        for next_done in asyncio.as_completed(encodings):
            n, data = await next_done
            yield (*todo[n], data)
    finally:
        for task in encodings:
            task.cancel()
