"""Between Darkroom's types and the public API's messages, each way written once:
a request's generation parameters in, jobs out (workers, totals and models:
``fleet_messages``)."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from gateway.adapters import requested
from gateway.inputs import InputImage, fit_within
from services.db.records import ImageRecord, JobRecord, SuspendEvent
from services.db.states import JobStatus
from services.generation import GenerationParams
from services.models.spec import ModelSpec
from services.rpc.chunks import split
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.telemetry import stages

STATUS = {s: pb.JobStatus.Value(f"JOB_STATUS_{s.value}") for s in JobStatus}
OUTPUT_FORMAT = {
    "png": pb.OUTPUT_FORMAT_PNG,
    "jpeg": pb.OUTPUT_FORMAT_JPEG,
    "webp": pb.OUTPUT_FORMAT_WEBP,
    "mp4": pb.OUTPUT_FORMAT_MP4,
}
DEFAULT_GUIDANCE = 7.5
# An upscale model's output is this many times its input, on each side.
UPSCALE = 4


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(when: datetime | None) -> timestamp_pb2.Timestamp | None:
    if when is None:
        return None
    # As Timestamp.FromDatetime does, in a fraction of its time: to the microsecond.
    delta = when - _EPOCH
    return timestamp_pb2.Timestamp(seconds=delta.days * 86400 + delta.seconds, nanos=delta.microseconds * 1000)


def generation_params(
    req: pb.SubmitJobRequest,
    spec: ModelSpec | None,
    image: InputImage | None = None,
    mask: InputImage | None = None,
) -> GenerationParams:
    """What ``req`` asks the model to make, the model's defaults where it says
    nothing: an edit's size is its input image's (fitted to the model), an
    upscale's four times its input's."""
    width, height = (spec.default_width, spec.default_height) if spec else (0, 0)
    if image is not None and spec is not None:
        if spec.upscales:
            width, height = image.width * UPSCALE, image.height * UPSCALE
        elif spec.edits:
            width, height = fit_within(image.width, image.height, spec)
    video = spec is not None and spec.makes_video
    whole = spec is not None and (spec.upscales or spec.instruction_edits)  # the input is no starting point
    edit_strength = 1.0 if mask is not None or image is None or whole else 0.8
    return GenerationParams(
        model=spec.name if spec is not None else req.model,
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        width=req.width or width,
        height=req.height or height,
        steps=req.steps or (spec.default_steps if spec else 0),
        guidance_scale=float(req.guidance_scale)
        if req.HasField("guidance_scale")
        else (spec.default_guidance if spec else DEFAULT_GUIDANCE),
        # Fixed at submit so that a retried attempt reproduces the same image.
        seed=req.seed if req.HasField("seed") else secrets.randbits(63),
        num_images=req.num_images or 1,
        frames=req.frames or (spec.default_frames if video and spec else 1),
        fps=float(req.fps) or (spec.default_fps if video and spec else 0.0),
        strength=float(req.strength) if req.HasField("strength") else edit_strength,
        image_digest=image.digest if image is not None else "",
        mask_digest=mask.digest if mask is not None else "",
        adapters=requested(req),  # their versions resolved against the store before the job is stored
    )


def job_message(job: JobRecord, images: list[ImageRecord] | None = None) -> pb.Job:
    routing = job.routing or {}
    return pb.Job(
        job_id=job.id,
        status=STATUS[job.status],
        model=job.params.model,
        prompt=job.params.prompt,
        expanded_prompt=job.expanded_prompt or "",
        width=job.params.width,
        height=job.params.height,
        steps=job.params.steps,
        num_images=job.params.num_images,
        lane=job.lane,
        progress=pb.Progress(step=job.progress_step, total=job.progress_total or job.params.steps),
        timings=pb.StageTimings(
            created_time=timestamp(job.created_at),
            scheduled_time=timestamp(job.scheduled_at),
            started_time=timestamp(job.started_at),
            decoding_time=timestamp(job.decoding_at),
            finished_time=timestamp(job.finished_at),
            dispatched_time=timestamp(job.dispatched_at),
            decoded_time=timestamp(job.decoded_at),
        ),
        stage_durations=pb.StageDurations(**{f"{stage}_seconds": s for stage, s in stage_durations(job).items()}),
        worker_id=job.worker_id or "",
        attempts=job.attempt,
        error=job.error,
        routing=pb.Routing(
            worker_id=routing.get("worker_id") or "",
            reason=routing.get("reason", ""),
            candidates=[
                pb.RoutingCandidate(
                    worker_id=c["worker_id"], eligible=c["eligible"], score_seconds=c["finish_s"] or 0.0, note=c["note"]
                )
                for c in routing.get("candidates", [])
            ],
        ),
        images=[
            pb.Image(
                data=i.data,
                mime_type=i.mime_type,
                width=i.width,
                height=i.height,
                seed=i.seed,
                frames=job.params.frames,
                fps=job.params.fps,
                nsfw_score=i.nsfw_score,
                verdict=i.verdict,
            )
            for i in images or []
        ],
        deadline=timestamp(job.deadline),
        starts=job.starts,
        output_format=OUTPUT_FORMAT[job.output_format],
        batch_images=job.batch_rows or 0,
        joined_batch_images=job.joined_rows or 0,
        cached_steps=job.cached_steps or 0,
        failed_attempts=[
            pb.AttemptFailure(attempt=f.attempt, worker_id=f.worker_id, error=f.error) for f in job.attempt_log
        ],
        checkpoint_step=job.checkpoint_step,
        suspensions=[suspension(e) for e in job.suspensions],
        resumptions=[suspension(e) for e in job.resumptions],
        gpu_seconds=job.gpu_seconds,
        credits_reserved=job.credits_reserved,
        credits_charged=job.credits_charged,
        frames=job.params.frames,
        fps=job.params.fps,
        strength=job.params.strength,
        adapters=[pb.Adapter(name=f"{a.name}:{a.version}", scale=a.scale) for a in job.params.adapters],
        task=job.task.value,
        waiting_for=routing.get("waiting_for", "") if job.status == JobStatus.QUEUED else "",
        output_policy=job.output_policy,
    )


def suspension(event: SuspendEvent) -> pb.Suspension:
    return pb.Suspension(
        attempt=event.attempt,
        worker_id=event.worker_id,
        step=event.step,
        total=event.total,
        reason=event.reason,
        time=timestamp(event.at),
    )


def stage_durations(job: JobRecord) -> dict[str, float]:
    """Seconds per stage of the job's latest attempt (``services.telemetry.stages``). A job
    that ended without a result has no ``store`` stage and no total."""
    stored = job.finished_at if job.status == JobStatus.SUCCEEDED else None
    times = (job.created_at, job.scheduled_at, job.dispatched_at, job.started_at, job.decoding_at, job.decoded_at)
    return stages.durations((*times, stored))


def image_chunks(job: JobRecord, image: ImageRecord) -> list[pb.JobEvent]:
    return [
        pb.JobEvent(
            job_id=job.id,
            image_chunk=pb.ImageChunk(
                index=image.index,
                offset=offset,
                data=data,
                last=last,
                mime_type=image.mime_type,
                width=image.width,
                height=image.height,
                seed=image.seed,
                frames=job.params.frames,
                fps=job.params.fps,
                nsfw_score=image.nsfw_score,
                verdict=image.verdict,
            ),
        )
        for offset, data, last in split(image.data)
    ]
