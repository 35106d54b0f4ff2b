"""The HTTP API's calls to the gRPC gateway, each with the caller's own key: the
gateway authenticates, owns and limits every job as it does for gRPC clients.

A submit that finds the gateway away is tried again with the same idempotency key
(one job, however many tries reach it); a job followed across a gateway's restart
is followed again: the gateway holds no job state, and a stream joined late
yields the job's state and its outputs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.rpc.server import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

# How long the models list (for the default model of a request naming none) is kept.
MODELS_FOR_S = 5.0
# The pauses between tries of a submit that found the gateway away, or got no answer in time.
SUBMIT_RETRY_DELAYS_S = (0.25, 1.0)
SUBMIT_TIMEOUT_S = 30.0
# How long a job is followed through a gateway that is away before the wait gives up.
FOLLOW_OUTAGE_S = 30.0
_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def channel_to(address: str, tls_ca: str) -> grpc.aio.Channel:
    """Plaintext, or TLS trusting ``tls_ca`` (``system``: the system's CAs)."""
    if not tls_ca:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    roots = None if tls_ca == "system" else Path(tls_ca).read_bytes()
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(roots), options=CHANNEL_OPTIONS)


@dataclass
class Finished:
    """A job at its end, with its outputs."""

    job: pb.Job
    outputs: list[pb.Image]


@dataclass
class _Output:
    parts: list[bytes] = field(default_factory=list)
    chunk: pb.ImageChunk | None = None


class Outputs:
    """A job's outputs put together from its stream's chunks."""

    def __init__(self) -> None:
        self._outputs: dict[int, _Output] = {}

    def add(self, event: pb.JobEvent) -> Finished | None:
        """Takes one event; the finished job at its terminal event."""
        kind = event.WhichOneof("event")
        if kind == "image_chunk":
            chunk = event.image_chunk
            output = self._outputs.setdefault(chunk.index, _Output())
            output.parts.append(chunk.data)
            output.chunk = chunk
        elif kind == "terminal":
            return Finished(event.terminal, [_image(self._outputs[i]) for i in sorted(self._outputs)])
        return None


class Gateway:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.stub = image_generation_pb2_grpc.ImageGenerationStub(channel)
        self._models: tuple[float, pb.ListModelsResponse] | None = None

    @staticmethod
    def _metadata(key: str) -> list[tuple[str, str]] | None:
        return [("authorization", f"Bearer {key}")] if key else None

    async def submit(self, request: pb.SubmitJobRequest, key: str) -> pb.SubmitJobResponse:
        """The job stored, or the one an earlier submit with its idempotency key
        stored; tried again while the gateway is away (UNAVAILABLE, or no answer in
        time), and then the last refusal."""
        for delay in (*SUBMIT_RETRY_DELAYS_S, None):
            try:
                return await self.stub.SubmitJob(request, metadata=self._metadata(key), timeout=SUBMIT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if delay is None or exc.code() not in _AWAY or not request.idempotency_key:
                    raise
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def check(self, key: str) -> None:
        """Whether the gateway admits ``key`` (empty: no key): a ListModels call,
        its answer kept as the models list; the gateway's refusal otherwise."""
        found = await self.stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata(key), timeout=10)
        self._models = (time.monotonic(), found)

    async def cancel(self, job_id: str, key: str) -> pb.CancelJobResponse:
        return await self.stub.CancelJob(pb.CancelJobRequest(job_id=job_id), metadata=self._metadata(key), timeout=30)

    async def jobs(self, key: str, page_size: int, page_token: str = "") -> pb.ListJobsResponse:
        request = pb.ListJobsRequest(page_size=page_size, page_token=page_token)
        return await self.stub.ListJobs(request, metadata=self._metadata(key), timeout=30)

    async def get(self, job_id: str, key: str) -> pb.Job:
        return await self.stub.GetJob(pb.GetJobRequest(job_id=job_id), metadata=self._metadata(key), timeout=30)

    def events(self, job_id: str, key: str, timeout_s: float) -> AsyncIterator[pb.JobEvent]:
        """The job's StreamJob events, to its terminal one."""
        return self.stub.StreamJob(pb.StreamJobRequest(job_id=job_id), metadata=self._metadata(key), timeout=timeout_s)

    async def finished(self, job_id: str, key: str, timeout_s: float) -> Finished | None:
        """The job at its end, its outputs put together from the stream's chunks;
        None when it has not ended within ``timeout_s``. A gateway that goes away
        meanwhile is waited for (``FOLLOW_OUTAGE_S`` at most), and the job followed
        again from its current state."""
        deadline = time.monotonic() + timeout_s
        away_since: float | None = None
        delay = 0.25
        while True:
            outputs = Outputs()
            try:
                async for event in self.events(job_id, key, max(0.001, deadline - time.monotonic())):
                    away_since = None
                    done = outputs.add(event)
                    if done is not None:
                        return done
                # The stream ended without its terminal event: the job, with its outputs, as GetJob has it.
                job = await self.get(job_id, key)
                return Finished(job, list(job.images))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the wait's own deadline
                    return None
                now = time.monotonic()
                away_since = now if away_since is None else away_since
                if exc.code() != grpc.StatusCode.UNAVAILABLE or now - away_since + delay > FOLLOW_OUTAGE_S:
                    raise
                if now + delay >= deadline:
                    return None
                log.info("job %s: the gateway is away (%s); following it again in %.2fs", job_id, exc.details(), delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)

    async def models(self, key: str) -> pb.ListModelsResponse:
        """The gateway's models, read at most every MODELS_FOR_S."""
        if self._models is None or time.monotonic() - self._models[0] > MODELS_FOR_S:
            found = await self.stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata(key), timeout=30)
            self._models = (time.monotonic(), found)
        return self._models[1]

    async def close(self) -> None:
        await self.channel.close()


def _image(output: _Output) -> pb.Image:
    c = output.chunk
    assert c is not None
    return pb.Image(
        data=b"".join(output.parts),
        mime_type=c.mime_type,
        width=c.width,
        height=c.height,
        seed=c.seed,
        frames=c.frames,
        fps=c.fps,
        nsfw_score=c.nsfw_score if c.HasField("nsfw_score") else None,
        verdict=c.verdict,
    )


def default_model(models: pb.ListModelsResponse, capability: str) -> str:
    """The default model of ``capability``, or empty when the gateway has none (it then names the problem)."""
    of_kind = [m for m in models.models if m.capability == capability]
    return next((m.name for m in of_kind if m.is_default), of_kind[0].name if of_kind else "")
