"""Turning a job's latents into images: on a decoder service (``VaeDecoder.Decode``),
on another one when one fails or disappears mid-stream, and on this sampler itself
as a last resort when ``local_decode_fallback`` allows it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc
import torch

from services.db.records import ImageRecord, JobRecord, WorkerRecord
from services.db.repository import Repository
from services.db.states import WorkerKind
from services.errors import DarkroomError, StoreError
from services.models.vae import VaeDecoderEngine, encode_png
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.server import channel

log = logging.getLogger("darkroom.gpu_worker.decoders")

# How long a job waits for some decoder to take it before its attempt fails.
DECODE_PATIENCE_S = 30.0
DECODE_TIMEOUT_S = 120.0
ROUND_PAUSE_S = 0.5


class DecodeUnavailable(DarkroomError):
    """No decoder could decode the job's latents: the attempt fails, to be retried."""


class DecoderFailed(DarkroomError):
    pass


def latents_to_request(job: JobRecord, latents: torch.Tensor) -> vae_decoder_pb2.DecodeRequest:
    array = latents.detach().to("cpu", torch.float32).contiguous().numpy()
    return vae_decoder_pb2.DecodeRequest(
        model=job.model,
        latents=array.astype("<f4").tobytes(),
        shape=list(array.shape),
        dtype="float32",
        mime_type="image/png",
        job_id=job.id,
    )


class Decoders:
    def __init__(
        self,
        repo: Repository,
        *,
        stale_after_s: float,
        local: VaeDecoderEngine | None = None,
        patience_s: float = DECODE_PATIENCE_S,
    ) -> None:
        self.repo = repo
        self.stale_after_s = stale_after_s
        self.local = local
        self.patience_s = patience_s
        self._rotation = itertools.count()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._known: list[WorkerRecord] = []

    async def decode(self, job: JobRecord, latents: torch.Tensor) -> list[ImageRecord]:
        request = latents_to_request(job, latents)
        deadline = time.monotonic() + self.patience_s
        failures: list[str] = []
        while True:
            for decoder in await self._candidates():
                try:
                    return await self._decode_on(decoder, request, job)
                except DecoderFailed as exc:
                    log.warning("job %s: %s; trying another decoder", job.id, exc)
                    failures.append(str(exc))
            if self.local is not None:
                log.warning("job %s: no decoder service could decode it; decoding here", job.id)
                return await asyncio.to_thread(self._decode_locally, job, latents)
            if time.monotonic() >= deadline:
                tried = "; ".join(failures[-3:]) or "no decoder is registered"
                raise DecodeUnavailable(f"no decoder could decode it in {self.patience_s:.0f}s ({tried})")
            await asyncio.sleep(ROUND_PAUSE_S)

    async def _candidates(self) -> list[WorkerRecord]:
        """The live decoders, starting at a different one each time. While the
        database is away, the last ones it named."""
        try:
            self._known = await self.repo.workers.live(WorkerKind.DECODER, stale_after_s=self.stale_after_s)
        except StoreError as exc:
            log.warning("cannot list decoders, using the last known: %s", exc)
        if not self._known:
            return []
        start = next(self._rotation) % len(self._known)
        return self._known[start:] + self._known[:start]

    async def _decode_on(
        self, decoder: WorkerRecord, request: vae_decoder_pb2.DecodeRequest, job: JobRecord
    ) -> list[ImageRecord]:
        ch = self._channels.get(decoder.address)
        if ch is None:
            ch = self._channels[decoder.address] = channel(decoder.address)
        stub = vae_decoder_pb2_grpc.VaeDecoderStub(ch)
        parts: dict[int, list[bytes]] = {}
        meta: dict[int, vae_decoder_pb2.DecodeChunk] = {}
        try:
            async for chunk in stub.Decode(request, timeout=DECODE_TIMEOUT_S):
                parts.setdefault(chunk.index, []).append(chunk.data)
                if chunk.last:
                    meta[chunk.index] = chunk
        except grpc.aio.AioRpcError as exc:
            raise DecoderFailed(f"decoder {decoder.id} failed: {exc.code().name} {exc.details()}") from exc
        if sorted(meta) != list(range(job.num_images)):
            raise DecoderFailed(f"decoder {decoder.id} returned images {sorted(meta)} for {job.num_images} latents")
        return [
            ImageRecord(
                index=i,
                data=b"".join(parts[i]),
                mime_type=meta[i].mime_type,
                width=meta[i].width,
                height=meta[i].height,
                seed=(job.seed + i) % 2**63,
            )
            for i in range(job.num_images)
        ]

    def _decode_locally(self, job: JobRecord, latents: torch.Tensor) -> list[ImageRecord]:
        assert self.local is not None
        images = []
        for i, pixels in enumerate(self.local.decode(job.model, latents.detach().to("cpu", torch.float32))):
            height, width = pixels.shape[:2]
            images.append(ImageRecord(i, encode_png(pixels), "image/png", width, height, (job.seed + i) % 2**63))
        return images

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
