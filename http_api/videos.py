"""OpenAI's videos API in Darkroom's terms: a create's form (``prompt``, ``model``,
``seconds``, ``size``, and Darkroom's ``frames``, ``fps``, ``steps``, ``seed``) as a
video job, its frames from its seconds at the model's rate and rule; and a video
job as OpenAI's ``Video`` object. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from http_api.errors import bad_request
from http_api.images import Fields, parse_size
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

STATUSES = {
    pb.JOB_STATUS_QUEUED: "queued",
    pb.JOB_STATUS_SCHEDULED: "queued",
    pb.JOB_STATUS_RUNNING: "in_progress",
    pb.JOB_STATUS_DECODING: "in_progress",
    pb.JOB_STATUS_SUCCEEDED: "completed",
}
FORMATS = {"mp4": pb.OUTPUT_FORMAT_MP4, "webp": pb.OUTPUT_FORMAT_WEBP}


def create(fields: Mapping[str, Any], model: pb.ModelInfo) -> pb.SubmitJobRequest:
    """The video job a create asks ``model`` for; HttpError (400) naming the first
    bad parameter. ``seconds`` become the nearest frame count the model's rule
    allows at its fps (``frames`` and ``fps`` say so directly)."""
    take = Fields(fields, form=True)
    request = pb.SubmitJobRequest(prompt=take.text("prompt", required=True), model=model.name)
    take.text("model")  # already chosen
    size = take.text("size")
    if size:
        request.width, request.height = parse_size(size, "832x480")
    fps = take.number("fps", 1.0, 120.0) or model.default_fps
    request.fps = fps
    frames = take.integer("frames", 2, 100_000)
    seconds = take.number("seconds", 0.01, 600.0)
    if frames is None and seconds is not None:
        frames = _frames_for(seconds, fps, model)
    if frames is not None:
        request.frames = frames
    for name in ("steps", "seed"):
        value = take.integer(name, 1 if name == "steps" else 0, 1000 if name == "steps" else 2**63 - 1)
        if value is not None:
            setattr(request, name, value)
    fmt = take.text("output_format") or "mp4"
    if fmt not in FORMATS:
        raise bad_request("output_format", f"output_format {fmt!r} is not mp4 or webp")
    request.output_format = FORMATS[fmt]
    take.done()
    return request


def _frames_for(seconds: float, fps: float, model: pb.ModelInfo) -> int:
    step = max(model.frames_step, 1)
    frames = 1 + step * max(1, round(seconds * fps / step))
    if frames > model.max_frames:
        longest = (model.max_frames - 1) / fps
        raise bad_request(
            "seconds",
            f"{seconds:g} s at {fps:g} fps is {frames} frames; {model.name} makes at most {model.max_frames} "
            f"({longest:.2f} s)",
        )
    return frames


def is_video(job: pb.Job) -> bool:
    return job.task == "text_to_video"


def video_list(jobs: list[pb.Job], *, limit: int, after: str, order: str) -> dict[str, Any]:
    """OpenAI's list of videos: ``jobs`` (the caller's, newest first) that are
    videos, in ``order``, after the video ``after`` (none: from the first), at
    most ``limit``; ``last_id`` is the next page's ``after``. 400 naming ``after``
    when it is none of them."""
    found = [job for job in jobs if is_video(job)]
    if order == "asc":
        found.reverse()
    if after:
        ids = [job.job_id for job in found]
        if after not in ids:
            raise bad_request("after", f"after {after!r} is none of your videos")
        found = found[ids.index(after) + 1 :]
    page = found[:limit]
    return {
        "object": "list",
        "data": [video_object(job) for job in page],
        "first_id": page[0].job_id if page else None,
        "last_id": page[-1].job_id if page else None,
        "has_more": len(found) > limit,
    }


def deleted(job_id: str, cancelled: bool) -> dict[str, Any]:
    """OpenAI's answer to a video's deletion: ``deleted`` when the job was cancelled
    before it made the video; a video already made (or failed) stays stored."""
    return {"id": job_id, "object": "video.deleted", "deleted": cancelled}


def video_object(job: pb.Job) -> dict[str, Any]:
    """A video job as OpenAI's ``Video``."""
    total = job.progress.total or job.steps or 1
    status = STATUSES.get(job.status, "failed")
    finished = job.timings.finished_time.seconds if job.timings.HasField("finished_time") else None
    return {
        "id": job.job_id,
        "object": "video",
        "created_at": job.timings.created_time.seconds,
        "completed_at": finished if status == "completed" else None,
        "expires_at": None,
        "error": {"code": pb.JobStatus.Name(job.status).lower(), "message": job.error} if status == "failed" else None,
        "model": job.model,
        "progress": 100 if status == "completed" else math.floor(100 * job.progress.step / total),
        "prompt": job.prompt,
        "remixed_from_video_id": None,
        "seconds": f"{(job.frames - 1) / job.fps:g}" if job.fps else "0",
        "size": f"{job.width}x{job.height}",
        "status": status,
    }
