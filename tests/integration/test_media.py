"""Video, edits and upscales through the gRPC API, on real processes: a video job
comes back as an MP4 (or animated WebP) of its frames, size and fps, and, suspended
by urgent image work, resumes to exactly its uninterrupted video; an edit depends
on its input image and is exact when batched; an upscale is four times its input."""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image

from services.models.video_encoding import probe_video, read_frames
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import CHECKPOINTED_MEDIA, png_size, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration

VIDEO: dict[str, Any] = dict(model="tiny-wan", prompt="waves", width=64, height=48, steps=4, frames=9, fps=8.0, seed=3)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("media")
    registry = tmp / "registry.toml"
    registry.write_text(CHECKPOINTED_MEDIA)
    s = make_stack(
        tmp / "stack",
        postgres,
        models_dir,
        model_registry=str(registry),
        # Paid image work has a 0.5 s target; video is best effort (the default):
        # urgent images preempt a video.
        lanes=("paid:10:120:0.5", "free:0:300"),
        preempt_for_targets=True,
        batch_wait_ms=1500.0,
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def picture(seed: int, width: int = 64, height: int = 64) -> bytes:
    return png(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_a_video_job_comes_back_as_an_mp4_of_its_frames_size_and_fps(stack: LocalStack) -> None:
    client = stub(stack)
    job = wait_terminal(client, client.SubmitJob(pb.SubmitJobRequest(**VIDEO)).job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert (job.task, job.frames, job.fps) == ("text_to_video", 9, 8.0)
    [video] = job.images
    assert (video.mime_type, video.frames, video.fps, video.width, video.height) == ("video/mp4", 9, 8.0, 64, 48)
    info = probe_video(video.data)
    assert (info.mime_type, info.frames, info.width, info.height, info.fps) == ("video/mp4", 9, 64, 48, 8.0)
    assert read_frames(video.data).std() > 1.0  # frames, not a blank

    webp = wait_terminal(
        client, client.SubmitJob(pb.SubmitJobRequest(**VIDEO, output_format=pb.OUTPUT_FORMAT_WEBP)).job_id
    )
    assert webp.status == pb.JOB_STATUS_SUCCEEDED, webp.error
    info = probe_video(webp.images[0].data)
    assert (info.mime_type, info.frames, info.width, info.height, info.fps) == ("image/webp", 9, 64, 48, 8.0)


def test_a_video_of_wan22_s_two_experts_comes_back_as_an_mp4(stack: LocalStack) -> None:
    """Its four steps cross the boundary: two on each expert (tests/unit/test_wan22.py)."""
    client = stub(stack)
    job = wait_terminal(client, client.SubmitJob(pb.SubmitJobRequest(**{**VIDEO, "model": "tiny-wan22"})).job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    [video] = job.images
    info = probe_video(video.data)
    assert (info.mime_type, info.frames, info.width, info.height, info.fps) == ("video/mp4", 9, 64, 48, 8.0)
    assert read_frames(video.data).std() > 1.0


def test_a_video_preempted_by_urgent_image_work_resumes_to_its_uninterrupted_video(stack: LocalStack) -> None:
    client = stub(stack)
    # Seconds of work left when the urgent job comes, well past its lane's 0.5 s
    # target (the tiny network's step is milliseconds): a suspension pays.
    long = {**VIDEO, "steps": 200, "width": 128, "height": 96, "frames": 17, "seed": 5}
    job_id = client.SubmitJob(pb.SubmitJobRequest(**long, lane="free")).job_id
    wait_for(
        lambda: client.GetJob(pb.GetJobRequest(job_id=job_id)),
        lambda j: j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= 3,
        timeout=120,
        what="the video running",
    )
    urgent = client.SubmitJob(
        pb.SubmitJobRequest(model="tiny", prompt="now", width=64, height=64, steps=2, lane="paid")
    )
    assert wait_terminal(client, urgent.job_id).status == pb.JOB_STATUS_SUCCEEDED
    video = wait_terminal(client, job_id, timeout=300)
    assert video.status == pb.JOB_STATUS_SUCCEEDED, video.error
    [suspension] = video.suspensions
    assert suspension.reason == f"preempted for {urgent.job_id}" and 0 < suspension.step < long["steps"]
    [resumption] = video.resumptions
    assert resumption.step == suspension.step
    again = wait_terminal(client, client.SubmitJob(pb.SubmitJobRequest(**long, lane="paid")).job_id, timeout=300)
    assert again.status == pb.JOB_STATUS_SUCCEEDED and not again.suspensions
    assert video.images[0].data == again.images[0].data


def submit_together(client, requests: list[pb.SubmitJobRequest]) -> list[pb.Job]:
    with ThreadPoolExecutor(len(requests)) as pool:
        ids = [r.job_id for r in pool.map(client.SubmitJob, requests)]
    return [wait_terminal(client, job_id) for job_id in ids]


def test_edits_depend_on_their_input_and_are_exact_when_batched(stack: LocalStack) -> None:
    client = stub(stack)
    mask = np.zeros((64, 64, 3), dtype=np.uint8)
    mask[:, 32:] = 255
    shape: dict[str, Any] = dict(model="tiny", prompt="a door", width=64, height=64, steps=8, seed=21, lane="paid")
    requests = [
        pb.SubmitJobRequest(**shape, image=picture(1), strength=0.6),
        pb.SubmitJobRequest(**shape, image=picture(2), strength=0.6),
        pb.SubmitJobRequest(**shape, image=picture(1), mask=png(mask)),
        pb.SubmitJobRequest(**shape),
    ]
    jobs = submit_together(client, requests)
    assert [j.status for j in jobs] == [pb.JOB_STATUS_SUCCEEDED] * 4, [j.error for j in jobs]
    assert [j.task for j in jobs] == ["image_to_image", "image_to_image", "inpaint", "text_to_image"]
    assert max(j.batch_images for j in jobs) > 1, [(j.batch_images, j.routing.reason) for j in jobs]
    assert all(png_size(j.images[0].data) == (64, 64) for j in jobs)
    images = [j.images[0].data for j in jobs]
    assert len(set(images)) == 4, "each depends on its input image, mask and strength"
    for request, batched in zip(requests, jobs, strict=True):
        solo = wait_terminal(client, client.SubmitJob(request).job_id)
        assert solo.status == pb.JOB_STATUS_SUCCEEDED and solo.batch_images == 1
        assert solo.images[0].data == batched.images[0].data


def test_an_upscale_is_four_times_its_input(stack: LocalStack) -> None:
    client = stub(stack)
    request = pb.SubmitJobRequest(model="tiny-upscaler", prompt="sharp", image=picture(4, 32, 24), steps=4, seed=1)
    job = wait_terminal(client, client.SubmitJob(request).job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert job.task == "upscale" and (job.width, job.height) == (128, 96)
    assert png_size(job.images[0].data) == (128, 96)
    other = wait_terminal(
        client, client.SubmitJob(pb.SubmitJobRequest(**{**_fields(request), "image": picture(5, 32, 24)})).job_id
    )
    assert other.images[0].data != job.images[0].data, "it depends on its input"


def _fields(request: pb.SubmitJobRequest) -> dict[str, Any]:
    return {f.name: v for f, v in request.ListFields()}


BAD = [
    (dict(model="tiny-wan", frames=10), "frames", "1 plus a multiple of 4"),
    (dict(model="tiny-wan", frames=37), "frames", "5..33"),
    (dict(model="tiny-wan", frames=1), "frames", "5..33"),
    (dict(model="tiny-wan", fps=500.0), "fps", "1..120"),
    (dict(model="tiny-wan", image=b"x"), "image", ""),
    (dict(model="tiny-wan", output_format=pb.OUTPUT_FORMAT_PNG), "output_format", "for a video"),
    (dict(model="tiny", frames=9), "frames", "video model"),
    (dict(model="tiny", output_format=pb.OUTPUT_FORMAT_MP4), "output_format", "for an image"),
    (dict(model="tiny", image=b"not an image"), "image", "PNG, JPEG or WebP"),
    (dict(model="tiny", mask=b"..."), "mask", "needs an input image"),
    (dict(model="tiny", image=b"IMAGE", mask=b"SMALL"), "mask", "the input image's size"),
    (dict(model="tiny", image=b"IMAGE", strength=0.0), "strength", "(0, 1]"),
    (dict(model="tiny", strength=0.5), "strength", "edits"),
    (dict(model="tiny-upscaler"), "image", "is required"),
    # A width of the model's grid (one off it is refused before the image is read).
    (dict(model="tiny-upscaler", image=b"IMAGE", width=64), "width", "four times its input"),
]


@pytest.mark.parametrize(("fields", "field", "says"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_media_request_is_refused_naming_the_field_and_stores_nothing(
    stack: LocalStack, fields: dict[str, Any], field: str, says: str
) -> None:
    client = stub(stack)
    values = {"prompt": "a cat", **fields}
    values = {k: picture(9) if v == b"IMAGE" else picture(9, 32, 32) if v == b"SMALL" else v for k, v in values.items()}
    before = [j.job_id for j in client.ListJobs(pb.ListJobsRequest(page_size=200)).jobs]
    with pytest.raises(grpc.RpcError) as refused:
        client.SubmitJob(pb.SubmitJobRequest(**values))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(refused.value)
    assert status is not None
    violations = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            violations += [(v.field, v.description) for v in bad.field_violations]
    assert any(f == field and says in d for f, d in violations), violations
    assert [j.job_id for j in client.ListJobs(pb.ListJobsRequest(page_size=200)).jobs] == before
