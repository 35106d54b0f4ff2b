"""A client of the public API, used by ``darkroom generate`` and the fault suite.

It rides out what a production client meets: a submit refused while the database
is away (retried with the same idempotency key, after the server's RetryInfo), and
a ``StreamJob`` that breaks (the connection, the gateway restarting), reopened to
get the current state and the result. Each image reaches the caller once."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc

# A call failing with one of these may succeed if tried again.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# A stream that breaks with one of these is reopened.
STREAM_BROKEN = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
)


@dataclass
class GeneratedImage:
    data: bytes
    mime_type: str
    width: int
    height: int
    seed: int
    nsfw_score: float | None = None  # the image filter's; None: not checked
    verdict: str = ""  # "", "flagged", "blurred" or "blocked" (then ``data`` is empty)


class JobFailed(RuntimeError):
    pass


class StreamProtocolError(RuntimeError):
    """The server sent something twice, or out of order, within one stream."""


@dataclass
class StreamLog:
    """What one client saw of a job: how many streams it opened, and every event."""

    opened: int = 0
    events: list[list[pb.JobEvent]] = field(default_factory=list)
    refusals: list[grpc.StatusCode] = field(default_factory=list)


def collect_stream(
    events: Iterable[pb.JobEvent], on_progress: Callable[[int, int], None] | None = None
) -> tuple[pb.Job, list[GeneratedImage]]:
    """Reads one StreamJob stream to its terminal event; returns the job and its
    images. Raises StreamProtocolError if the stream repeats itself."""
    parts: dict[int, bytearray] = {}
    meta: dict[int, pb.ImageChunk] = {}
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "progress" and on_progress is not None:
            on_progress(event.progress.step, event.progress.total)
        elif kind == "image_chunk":
            chunk = event.image_chunk
            if chunk.index in meta:
                raise StreamProtocolError(f"image {chunk.index} sent twice")
            buf = parts.setdefault(chunk.index, bytearray())
            if chunk.offset != len(buf):
                raise StreamProtocolError(f"image {chunk.index}: chunk at {chunk.offset}, expected {len(buf)}")
            buf.extend(chunk.data)
            if chunk.last:
                meta[chunk.index] = chunk
        elif kind == "terminal":
            images = [
                GeneratedImage(
                    bytes(parts[i]),
                    meta[i].mime_type,
                    meta[i].width,
                    meta[i].height,
                    meta[i].seed,
                    meta[i].nsfw_score if meta[i].HasField("nsfw_score") else None,
                    meta[i].verdict,
                )
                for i in sorted(meta)
            ]
            return event.terminal, images
    raise StreamProtocolError("the stream ended without a terminal event")


def retry_delay(exc: grpc.RpcError, default_s: float) -> float:
    """The server's RetryInfo delay, if it sent one."""
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    for detail in status.details if status else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return default_s


def submit(
    stub: image_generation_pb2_grpc.ImageGenerationStub,
    request: pb.SubmitJobRequest,
    *,
    metadata: list[tuple[str, str]] | None = None,
    patience_s: float = 60.0,
    log: StreamLog | None = None,
) -> pb.SubmitJobResponse:
    """Submits, retrying what may succeed later (with the same idempotency key, so
    a submit that did land is not made twice) for up to ``patience_s``."""
    if not request.idempotency_key:
        request = _with_key(request)
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return stub.SubmitJob(request, metadata=metadata, timeout=30)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code not in RETRYABLE or time.monotonic() > deadline:
                raise
            if log is not None:
                log.refusals.append(code)
            time.sleep(min(max(retry_delay(exc, 0.5), 0.1), 5.0))


def _with_key(request: pb.SubmitJobRequest) -> pb.SubmitJobRequest:
    keyed = pb.SubmitJobRequest()
    keyed.CopyFrom(request)
    keyed.idempotency_key = str(uuid.uuid4())
    return keyed


def follow(
    stub: image_generation_pb2_grpc.ImageGenerationStub,
    job_id: str,
    *,
    metadata: list[tuple[str, str]] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    patience_s: float = 60.0,
    log: StreamLog | None = None,
) -> tuple[pb.Job, list[GeneratedImage]]:
    """Streams the job to its end, reopening the stream when it breaks; gives up
    after ``patience_s`` without a working stream."""
    delay = 0.2
    last_heard = time.monotonic()
    while True:
        seen: list[pb.JobEvent] = []
        if log is not None:
            log.opened += 1
            log.events.append(seen)

        def recorded(stream: Iterable[pb.JobEvent], into: list[pb.JobEvent] = seen) -> Iterable[pb.JobEvent]:
            for event in stream:
                into.append(event)
                yield event

        try:
            stream = stub.StreamJob(pb.StreamJobRequest(job_id=job_id), metadata=metadata)
            return collect_stream(recorded(stream), on_progress)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            now = time.monotonic()
            if seen:
                last_heard, delay = now, 0.2
            if code not in STREAM_BROKEN or now - last_heard > patience_s:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def default_model(
    stub: image_generation_pb2_grpc.ImageGenerationStub,
    capability: str,
    *,
    metadata: list[tuple[str, str]] | None = None,
) -> str:
    """The gateway's default model of ``capability``; JobFailed if it serves none."""
    models = stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=30).models
    of_kind = [m for m in models if m.capability == capability]
    if not of_kind:
        raise JobFailed(f"the gateway serves no {capability} model")
    return next((m.name for m in of_kind if m.is_default), of_kind[0].name)


def progress_bar(step: int, total: int) -> None:
    width = 30
    filled = int(width * step / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}")
    sys.stderr.flush()
    if step >= total:
        sys.stderr.write("\n")


def gateway_channel(address: str, tls_roots: bytes | None = None) -> grpc.Channel:
    """A channel to a gateway: plaintext (None), or TLS trusting ``tls_roots`` (b"":
    the system's certificates)."""
    if tls_roots is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_roots or None))


def generate(
    address: str,
    request: pb.SubmitJobRequest,
    *,
    api_key: str = "",
    tls_roots: bytes | None = None,
    on_progress: Callable[[int, int], None] | None = progress_bar,
    capability: str = "image",
) -> tuple[pb.Job, list[GeneratedImage]]:
    """``tls_roots``: reach the gateway over TLS, trusting these certificates (b"":
    the system's). A request naming no model takes the gateway's default model of
    ``capability``."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with gateway_channel(address, tls_roots) as ch:
        stub = image_generation_pb2_grpc.ImageGenerationStub(ch)
        if not request.model:
            request.model = default_model(stub, capability, metadata=metadata)
        submitted = submit(stub, request, metadata=metadata)
        job, images = follow(stub, submitted.job_id, metadata=metadata, on_progress=on_progress)
    if job.status != pb.JOB_STATUS_SUCCEEDED:
        raise JobFailed(f"job {job.job_id} ended {pb.JobStatus.Name(job.status)}: {job.error}")
    return job, images
