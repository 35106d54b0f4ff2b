"""A small client of the public API, used by ``darkroom generate``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc


@dataclass
class GeneratedImage:
    data: bytes
    mime_type: str
    width: int
    height: int
    seed: int


class JobFailed(RuntimeError):
    pass


def collect_stream(
    events: object, on_progress: Callable[[int, int], None] | None = None
) -> tuple[pb.Job, list[GeneratedImage]]:
    """Reads a StreamJob stream to its terminal event; returns the job and its images."""
    parts: dict[int, bytearray] = {}
    meta: dict[int, pb.ImageChunk] = {}
    for event in events:  # type: ignore[attr-defined]
        kind = event.WhichOneof("event")
        if kind == "progress" and on_progress is not None:
            on_progress(event.progress.step, event.progress.total)
        elif kind == "image_chunk":
            chunk = event.image_chunk
            buf = parts.setdefault(chunk.index, bytearray())
            if chunk.offset != len(buf):
                raise RuntimeError(f"image {chunk.index}: chunk at {chunk.offset}, expected {len(buf)}")
            buf.extend(chunk.data)
            if chunk.last:
                meta[chunk.index] = chunk
        elif kind == "terminal":
            images = [
                GeneratedImage(bytes(parts[i]), meta[i].mime_type, meta[i].width, meta[i].height, meta[i].seed)
                for i in sorted(meta)
            ]
            return event.terminal, images
    raise RuntimeError("the stream ended without a terminal event")


def progress_bar(step: int, total: int) -> None:
    width = 30
    filled = int(width * step / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}")
    sys.stderr.flush()
    if step >= total:
        sys.stderr.write("\n")


def generate(
    address: str,
    request: pb.SubmitJobRequest,
    *,
    api_key: str = "",
    on_progress: Callable[[int, int], None] | None = progress_bar,
) -> tuple[pb.Job, list[GeneratedImage]]:
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.insecure_channel(address) as ch:
        stub = image_generation_pb2_grpc.ImageGenerationStub(ch)
        submitted = stub.SubmitJob(request, metadata=metadata, timeout=30)
        stream = stub.StreamJob(pb.StreamJobRequest(job_id=submitted.job_id), metadata=metadata)
        job, images = collect_stream(stream, on_progress)
    if job.status != pb.JOB_STATUS_SUCCEEDED:
        raise JobFailed(f"job {job.job_id} ended {pb.JobStatus.Name(job.status)}: {job.error}")
    return job, images
