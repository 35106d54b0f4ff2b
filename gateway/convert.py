"""Database records to public API messages."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from services.db.records import ImageRecord, JobRecord, SuspendEvent
from services.db.states import JobStatus
from services.rpc.chunks import split
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.telemetry import stages

STATUS = {s: pb.JobStatus.Value(f"JOB_STATUS_{s.value}") for s in JobStatus}
OUTPUT_FORMAT = {"png": pb.OUTPUT_FORMAT_PNG, "jpeg": pb.OUTPUT_FORMAT_JPEG, "webp": pb.OUTPUT_FORMAT_WEBP}


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(when: datetime | None) -> timestamp_pb2.Timestamp | None:
    if when is None:
        return None
    # As Timestamp.FromDatetime does, in a fraction of its time: to the microsecond.
    delta = when - _EPOCH
    return timestamp_pb2.Timestamp(seconds=delta.days * 86400 + delta.seconds, nanos=delta.microseconds * 1000)


def job_message(job: JobRecord, images: list[ImageRecord] | None = None) -> pb.Job:
    routing = job.routing or {}
    return pb.Job(
        job_id=job.id,
        status=STATUS[job.status],
        model=job.model,
        prompt=job.prompt,
        width=job.width,
        height=job.height,
        steps=job.steps,
        num_images=job.num_images,
        lane=job.lane,
        progress=pb.Progress(step=job.progress_step, total=job.progress_total or job.steps),
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
            pb.Image(data=i.data, mime_type=i.mime_type, width=i.width, height=i.height, seed=i.seed)
            for i in images or []
        ],
        deadline=timestamp(job.deadline),
        starts=job.starts,
        output_format=OUTPUT_FORMAT[job.output_format],
        batch_images=job.batch_rows or 0,
        failed_attempts=[
            pb.AttemptFailure(attempt=f.attempt, worker_id=f.worker_id, error=f.error) for f in job.attempt_log
        ],
        checkpoint_step=job.checkpoint_step,
        suspensions=[suspension(e) for e in job.suspensions],
        resumptions=[suspension(e) for e in job.resumptions],
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


def image_chunks(job_id: str, image: ImageRecord) -> list[pb.JobEvent]:
    return [
        pb.JobEvent(
            job_id=job_id,
            image_chunk=pb.ImageChunk(
                index=image.index,
                offset=offset,
                data=data,
                last=last,
                mime_type=image.mime_type,
                width=image.width,
                height=image.height,
                seed=image.seed,
            ),
        )
        for offset, data, last in split(image.data)
    ]
