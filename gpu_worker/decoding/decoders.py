"""Turning a batch's latents into images (or videos), in each job's output format: in
one call to the decoder service that will finish them first (``VaeDecoder.Decode``),
on another one when that fails or disappears mid-stream (only the jobs it did not
finish go), and on this sampler itself as a last resort when
``local_decode_fallback`` allows; or always on this sampler (``decode_locally``:
its decoder would share its GPU), the batch in one call. An edit's input image goes the other way, into
latents, the same way (``VaeDecoder.Encode``), and a prompt into its conditioning
where the decoders serve its model's text encoders (``prompt_encoders``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np
import torch

from gpu_worker import spans
from gpu_worker.decoding.decoder_choice import fastest_first
from gpu_worker.decoding.local_decode import Decoded, LocalDecoder
from services.db.records import ImageRecord, JobRecord
from services.db.states import WorkerKind
from services.db.worker_records import WorkerRecord
from services.errors import DarkroomError, InvalidArgument
from services.mesh.rpc import MeshIdentity
from services.models.encoding import mime_type_of
from services.presence_view import PresenceView
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.server import Channels
from services.rpc.status import field_violations
from services.telemetry import logs

log = logging.getLogger(__name__)

# How long a job waits for some decoder to take it before its attempt fails.
DECODE_PATIENCE_S = 30.0
DECODE_TIMEOUT_S = 120.0
ROUND_PAUSE_S = 0.5
# The live decoders are reread this often (and when none of them could decode).
DECODERS_REREAD_S = 1.0


class DecodeUnavailable(DarkroomError):
    """No decoder could decode the job's latents: the attempt fails, to be retried."""


class DecoderFailed(DarkroomError):
    pass


# What a job brings a decoder: a refusal naming it (an image that cannot be read, or
# none where its model's text encoder sees one) is the job's, and every decoder's.
_JOB_INPUTS = frozenset({"image", "mask"})


def refused_input(exc: grpc.aio.AioRpcError) -> InvalidArgument | None:
    """The job's own bad input where a decoder's refusal names it; None otherwise (a
    model another decoder's registry may serve, the call itself failing)."""
    own = [v for v in field_violations(exc) if v.field in _JOB_INPUTS]
    return InvalidArgument(own) if own else None


def decode_request(jobs: Sequence[tuple[JobRecord, torch.Tensor]], traceparents: Sequence[str | None]):
    """One request for the jobs' latents (one model, one latent shape), in order."""
    array = torch.cat([latents for _, latents in jobs]).detach().to("cpu", torch.float32).contiguous().numpy()
    return vae_decoder_pb2.DecodeRequest(
        model=jobs[0][0].params.model,
        latents=array.astype("<f4").tobytes(),
        shape=list(array.shape),
        dtype="float32",
        jobs=[
            vae_decoder_pb2.DecodeJob(
                job_id=job.id,
                images=int(latents.shape[0]),
                mime_type=mime_type_of(job.output_format),
                traceparent=traceparent or "",
                fps=job.params.fps,
                output_policy=job.output_policy,
            )
            for (job, latents), traceparent in zip(jobs, traceparents, strict=True)
        ],
    )


def _megapixels(jobs: Sequence[tuple[JobRecord, torch.Tensor]]) -> float:
    return sum(job.params.num_images * job.shape.pixels for job, _ in jobs) / 1e6


class Decoders:
    def __init__(
        self,
        presence: PresenceView,
        *,
        stale_after_s: float,
        local: LocalDecoder | None = None,
        patience_s: float = DECODE_PATIENCE_S,
        mesh: MeshIdentity | None = None,
        locally: bool = False,
        falls_back: bool = True,
        keep: Callable[[Sequence[tuple[JobRecord, torch.Tensor]]], Decoded | None] | None = None,
    ) -> None:
        if locally and local is None:
            raise ValueError("decoding locally needs a local decoder engine")
        self.presence = presence  # the decoders, as their heartbeats say
        self.stale_after_s = stale_after_s
        self.local = local
        self.locally = locally  # always here, never on a decoder service
        self.falls_back = falls_back and local is not None  # here where no decoder service can
        # Decodes here a batch it keeps rather than send (a group's videos, split across
        # it): their outcomes, or None. Run in a thread: it may wait for the device.
        self.keep = keep
        self.patience_s = patience_s
        self._rotation = itertools.count()
        self._channels = Channels(mesh)
        self._known: list[WorkerRecord] = []
        self._known_at = float("-inf")
        # Megapixels this sampler has sent each decoder and not had back.
        self._in_flight: dict[str, float] = {}

    async def decode(self, job: JobRecord, latents: torch.Tensor) -> list[ImageRecord]:
        """One job's images; raises what kept it from having them."""
        outcome = (await self.decode_many([(job, latents)]))[job.id]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def decode_many(self, jobs: Sequence[tuple[JobRecord, torch.Tensor]]) -> Decoded:
        """Each job's images (jobs of one model and size, a sampler's batch), or the
        DecodeUnavailable that ended its wait for a decoder."""
        if self.locally:
            assert self.local is not None
            return await asyncio.to_thread(self.local.decode_batch, jobs)
        if self.keep is not None and (kept := await asyncio.to_thread(self.keep, jobs)) is not None:
            return kept
        out: Decoded = {}
        pending = list(jobs)
        deadline = time.monotonic() + self.patience_s
        failures: list[str] = []
        while True:
            for decoder in fastest_first(await self._candidates(), _megapixels(pending), self._in_flight):
                megapixels = _megapixels(pending)
                self._in_flight[decoder.id] = self._in_flight.get(decoder.id, 0.0) + megapixels
                try:
                    decoded = await self._decode_on(decoder, pending)
                except DecoderFailed as exc:
                    log.warning(
                        "%d jobs: %s; trying another decoder",
                        len(pending),
                        exc,
                        extra=logs.jobs_fields(job.id for job, _ in pending),
                    )
                    failures.append(str(exc))
                    continue
                finally:
                    self._in_flight[decoder.id] -= megapixels
                for job, _ in pending:
                    outcome = decoded[job.id]
                    if isinstance(outcome, BaseException):
                        log.warning(
                            "job %s: %s; trying another decoder",
                            job.id,
                            outcome,
                            extra=logs.job_fields(job.id, job.attempt),
                        )
                        failures.append(str(outcome))
                    else:
                        out[job.id] = outcome
                pending = [(job, latents) for job, latents in pending if job.id not in out]
                if not pending:
                    return out
            self._known_at = float("-inf")  # none could: ask the registry again
            if self.falls_back:
                assert self.local is not None
                log.warning(
                    "%d jobs: no decoder service could decode them; decoding here",
                    len(pending),
                    extra=logs.jobs_fields(job.id for job, _ in pending),
                )
                for job, latents in pending:
                    try:
                        out[job.id] = await asyncio.to_thread(self.local.decode_job, job, latents)
                    except Exception as exc:
                        out[job.id] = exc
                return out
            if time.monotonic() >= deadline:
                tried = "; ".join(failures[-3:]) or "no decoder is registered"
                for job, _ in pending:
                    out[job.id] = DecodeUnavailable(f"no decoder could decode it in {self.patience_s:.0f}s ({tried})")
                return out
            await asyncio.sleep(ROUND_PAUSE_S)

    async def fastest_candidates(self) -> list[WorkerRecord]:
        """The live decoders, the one that would finish its held work first first."""
        return fastest_first(await self._candidates(), 0.0, self._in_flight)

    def stub(self, decoder: WorkerRecord) -> vae_decoder_pb2_grpc.VaeDecoderStub:
        return vae_decoder_pb2_grpc.VaeDecoderStub(self._channels.to(decoder.address))

    def reread(self) -> None:
        """None of them could: the registry is asked again next time."""
        self._known_at = float("-inf")

    async def _candidates(self) -> list[WorkerRecord]:
        """The live decoders, reread at most every DECODERS_REREAD_S, starting at a
        different one each time. While presence has heard from none (NATS away),
        the last ones it named."""
        if time.monotonic() - self._known_at >= DECODERS_REREAD_S:
            known = self.presence.live(WorkerKind.DECODER, stale_after_s=self.stale_after_s)
            if known or self.presence.settled_for(self.stale_after_s):
                self._known = known
            self._known_at = time.monotonic()
        if not self._known:
            return []
        start = next(self._rotation) % len(self._known)
        return self._known[start:] + self._known[:start]

    async def _decode_on(self, decoder: WorkerRecord, jobs: Sequence[tuple[JobRecord, torch.Tensor]]) -> Decoded:
        """One call for the jobs: each job's images, or the DecoderFailed that the
        decoder said of it; raises DecoderFailed when the call itself fails."""
        stub = vae_decoder_pb2_grpc.VaeDecoderStub(self._channels.to(decoder.address))
        parts: dict[tuple[int, int], list[bytes]] = {}
        meta: dict[tuple[int, int], vae_decoder_pb2.DecodeChunk] = {}
        refused: dict[int, str] = {}
        try:
            with spans.decode_call([job for job, _ in jobs], decoder.id) as traceparents:
                async for chunk in stub.Decode(decode_request(jobs, traceparents), timeout=DECODE_TIMEOUT_S):
                    if chunk.error:
                        refused[chunk.job] = chunk.error
                        continue
                    parts.setdefault((chunk.job, chunk.index), []).append(chunk.data)
                    if chunk.last:
                        meta[(chunk.job, chunk.index)] = chunk
        except grpc.aio.AioRpcError as exc:
            raise DecoderFailed(f"decoder {decoder.id} failed: {exc.code().name} {exc.details()}") from exc
        out: Decoded = {}
        for n, (job, _) in enumerate(jobs):
            got = sorted(i for j, i in meta if j == n)
            if n in refused:
                out[job.id] = DecoderFailed(f"decoder {decoder.id}: {refused[n]}")
            elif got != list(range(job.params.num_images)):
                out[job.id] = DecoderFailed(f"decoder {decoder.id} returned images {got} of {job.params.num_images}")
            elif job.output_policy and not all(meta[(n, i)].HasField("nsfw_score") for i in got):
                # A decoder that knows no image filter (an older one, mid-upgrade): never returned unchecked.
                out[job.id] = DecoderFailed(f"decoder {decoder.id} returned images the image filter did not check")
            else:
                out[job.id] = [
                    ImageRecord(
                        index=i,
                        data=b"".join(parts[(n, i)]),
                        mime_type=meta[(n, i)].mime_type,
                        width=meta[(n, i)].width,
                        height=meta[(n, i)].height,
                        seed=(job.params.seed + i) % 2**63,
                        nsfw_score=meta[(n, i)].nsfw_score if meta[(n, i)].HasField("nsfw_score") else None,
                        verdict=meta[(n, i)].verdict,
                    )
                    for i in range(job.params.num_images)
                ]
        return out

    async def encode(self, job: JobRecord, image: bytes, width: int, height: int) -> torch.Tensor:
        """An edit's input image resized to ``width`` x ``height`` as its model's
        latents (1, C, height/8, width/8), from a decoder service (or this sampler,
        where ``local_decode_fallback`` allows); DecodeUnavailable if none could
        within the patience; InvalidArgument where a decoder refuses the image itself."""
        p = job.params
        if self.locally:
            assert self.local is not None
            return await asyncio.to_thread(self.local.encode, job, image, width, height)
        request = vae_decoder_pb2.EncodeRequest(model=p.model, image=image, width=width, height=height, job_id=job.id)
        deadline = time.monotonic() + self.patience_s
        failures: list[str] = []
        while True:
            for decoder in await self._candidates():
                stub = vae_decoder_pb2_grpc.VaeDecoderStub(self._channels.to(decoder.address))
                try:
                    response = await stub.Encode(request, timeout=DECODE_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    refused = refused_input(exc)
                    if refused is not None:
                        raise refused from None
                    failures.append(f"decoder {decoder.id}: {exc.code().name} {exc.details()}")
                    continue
                array = np.frombuffer(response.latents, dtype="<f4").reshape(list(response.shape))
                return torch.from_numpy(array.copy())
            self._known_at = float("-inf")
            if self.falls_back:
                assert self.local is not None
                return await asyncio.to_thread(self.local.encode, job, image, width, height)
            if time.monotonic() >= deadline:
                tried = "; ".join(failures[-3:]) or "no decoder is registered"
                raise DecodeUnavailable(f"no decoder could encode its input image in {self.patience_s:.0f}s ({tried})")
            await asyncio.sleep(ROUND_PAUSE_S)

    async def close(self) -> None:
        await self._channels.close()
