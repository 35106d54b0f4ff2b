"""A job's prompt conditioning from a decoder service, for a model whose text encoders
it serves (``text_encoders = "service"``: ``VaeDecoder.EncodePrompt``): asked of the
decoder that would finish its held work first, another one when that fails, until
one answers or the patience is spent. Asked before the job's batch runs, beside its
input image (``gpu_worker.jobs.edit_inputs``); the loop finds it on the member."""

from __future__ import annotations

import asyncio
import time

import grpc

from gpu_worker.decoding.decoders import DECODE_TIMEOUT_S, ROUND_PAUSE_S, Decoders, DecodeUnavailable, refused_input
from gpu_worker.denoising.prompts import Conditioning
from services.db.records import JobRecord
from services.models import prompt_encoding
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2


class PromptEncodeUnavailable(DecodeUnavailable):
    """No decoder could encode the job's prompt: the attempt fails, to be retried."""


def encode_prompt_request(
    job: JobRecord, guided: bool, image: bytes = b"", image_size: tuple[int, int] = (0, 0)
) -> vae_decoder_pb2.EncodePromptRequest:
    p = job.params
    return vae_decoder_pb2.EncodePromptRequest(
        model=p.model,
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        guided=guided,
        width=p.width,
        height=p.height,
        image=image,
        image_width=image_size[0],
        image_height=image_size[1],
        job_id=job.id,
    )


async def served_conditioning(
    decoders: Decoders, job: JobRecord, guided: bool, image: bytes = b"", image_size: tuple[int, int] = (0, 0)
) -> Conditioning:
    """The job's conditioning (on the host) as a decoder encoded it; ``guided``: with
    its negative half; ``image``: the input its text encoder sees, at ``image_size``.
    PromptEncodeUnavailable when none could within the decoders' patience;
    InvalidArgument where a decoder refuses the job's image itself."""
    if decoders.locally:
        raise PromptEncodeUnavailable(
            f"{job.params.model}'s text encoders are the decoder service's, and this sampler calls none "
            '(decode_locally); give the model text_encoders = "device" on such a box'
        )
    request = encode_prompt_request(job, guided, image, image_size)
    deadline = time.monotonic() + decoders.patience_s
    failures: list[str] = []
    while True:
        for decoder in await decoders.fastest_candidates():
            try:
                response = await decoders.stub(decoder).EncodePrompt(request, timeout=DECODE_TIMEOUT_S)
                return Conditioning.of(prompt_encoding.from_bytes(response.conditioning))
            except grpc.aio.AioRpcError as exc:
                refused = refused_input(exc)
                if refused is not None:
                    raise refused from None
                # A model refused: another decoder's registry may serve it.
                failures.append(f"decoder {decoder.id}: {exc.code().name} {exc.details()}")
            except ValueError as exc:  # bytes that are no conditioning
                failures.append(f"decoder {decoder.id}: {exc}")
        decoders.reread()
        if time.monotonic() >= deadline:
            tried = "; ".join(failures[-3:]) or "no decoder is registered"
            raise PromptEncodeUnavailable(
                f"no decoder could encode the prompt of {job.params.model} in {decoders.patience_s:.0f}s ({tried})"
            )
        await asyncio.sleep(ROUND_PAUSE_S)
