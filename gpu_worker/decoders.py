"""Turning a job's latents into images, in the job's output format: on the decoder
service that will finish them first (``VaeDecoder.Decode``), on another one when one
fails or disappears mid-stream, and on this sampler itself as a last resort when
``local_decode_fallback`` allows it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc
import torch

from services import tracing
from services.db.records import ImageRecord, JobRecord, WorkerRecord
from services.db.repository import Repository
from services.db.states import WorkerKind
from services.errors import DarkroomError, StoreError
from services.models.encoding import encode, mime_type_of
from services.models.vae import VaeDecoderEngine
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.server import channel

log = logging.getLogger("darkroom.gpu_worker.decoders")

# How long a job waits for some decoder to take it before its attempt fails.
DECODE_PATIENCE_S = 30.0
# The live decoders are reread this often (and when none of them could decode).
DECODERS_REREAD_S = 1.0
DECODE_TIMEOUT_S = 120.0
ROUND_PAUSE_S = 0.5


class DecodeUnavailable(DarkroomError):
    """No decoder could decode the job's latents: the attempt fails, to be retried."""


class DecoderFailed(DarkroomError):
    pass


def estimated_finish_s(decoder: WorkerRecord, megapixels: float, in_flight: float = 0.0) -> float | None:
    """When ``decoder`` would finish ``megapixels`` more, from its heartbeated load:
    the work it holds (at least ``in_flight``, what this sampler has sent it since)
    times its measured seconds per megapixel. None while its speed is unknown."""
    speed = decoder.telemetry.get("seconds_per_megapixel")
    if not speed:
        return None
    held = max(float(decoder.telemetry.get("queued_megapixels") or 0.0), in_flight)
    return (held + megapixels) * float(speed)


def fastest_first(decoders: list[WorkerRecord], megapixels: float, in_flight: dict[str, float]) -> list[WorkerRecord]:
    """``decoders`` by estimated finish, ties in the given order; in the given order
    (a rotation) while any of them has no measured speed, so that each gets measured."""
    finish = [estimated_finish_s(d, megapixels, in_flight.get(d.id, 0.0)) for d in decoders]
    known = [f for f in finish if f is not None]
    if len(known) < len(decoders):
        return decoders
    return [decoders[i] for i in sorted(range(len(decoders)), key=known.__getitem__)]


def latents_to_request(job: JobRecord, latents: torch.Tensor) -> vae_decoder_pb2.DecodeRequest:
    array = latents.detach().to("cpu", torch.float32).contiguous().numpy()
    return vae_decoder_pb2.DecodeRequest(
        model=job.model,
        latents=array.astype("<f4").tobytes(),
        shape=list(array.shape),
        dtype="float32",
        mime_type=mime_type_of(job.output_format),
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
        self._known_at = float("-inf")
        # Megapixels this sampler has sent each decoder and not had back.
        self._in_flight: dict[str, float] = {}

    async def decode(self, job: JobRecord, latents: torch.Tensor) -> list[ImageRecord]:
        request = latents_to_request(job, latents)
        megapixels = job.num_images * job.width * job.height / 1e6
        deadline = time.monotonic() + self.patience_s
        failures: list[str] = []
        while True:
            for decoder in fastest_first(await self._candidates(), megapixels, self._in_flight):
                self._in_flight[decoder.id] = self._in_flight.get(decoder.id, 0.0) + megapixels
                try:
                    return await self._decode_on(decoder, request, job)
                except DecoderFailed as exc:
                    log.warning("job %s: %s; trying another decoder", job.id, exc)
                    failures.append(str(exc))
                finally:
                    self._in_flight[decoder.id] -= megapixels
            self._known_at = float("-inf")  # none could: ask the registry again
            if self.local is not None:
                log.warning("job %s: no decoder service could decode it; decoding here", job.id)
                return await asyncio.to_thread(self._decode_locally, job, latents)
            if time.monotonic() >= deadline:
                tried = "; ".join(failures[-3:]) or "no decoder is registered"
                raise DecodeUnavailable(f"no decoder could decode it in {self.patience_s:.0f}s ({tried})")
            await asyncio.sleep(ROUND_PAUSE_S)

    async def _candidates(self) -> list[WorkerRecord]:
        """The live decoders, reread at most every DECODERS_REREAD_S, starting at a
        different one each time. While the database is away, the last ones it named."""
        if time.monotonic() - self._known_at >= DECODERS_REREAD_S:
            try:
                self._known = await self.repo.workers.live(WorkerKind.DECODER, stale_after_s=self.stale_after_s)
                self._known_at = time.monotonic()
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
            with tracing.decode_call(job, decoder.id) as metadata:
                async for chunk in stub.Decode(request, timeout=DECODE_TIMEOUT_S, metadata=metadata):
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
        mime_type = mime_type_of(job.output_format)
        images = []
        for i, pixels in enumerate(self.local.decode(job.model, latents.detach().to("cpu", torch.float32))):
            height, width = pixels.shape[:2]
            images.append(ImageRecord(i, encode(pixels, mime_type), mime_type, width, height, (job.seed + i) % 2**63))
        return images

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
