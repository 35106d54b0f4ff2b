"""Each output format end to end through the real stack: SubmitJob names it, the job
shows it, and the images polled and streamed are files of that format and size."""

from __future__ import annotations

import io
from typing import cast

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image

from services.rpc.client import collect_stream
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import count_jobs, stub, wait_terminal

pytestmark = pytest.mark.integration

FORMATS = [
    # (asked, shown on the job, MIME type, magic bytes, PIL's name)
    (pb.OUTPUT_FORMAT_UNSPECIFIED, pb.OUTPUT_FORMAT_PNG, "image/png", b"\x89PNG\r\n\x1a\n", "PNG"),
    (pb.OUTPUT_FORMAT_PNG, pb.OUTPUT_FORMAT_PNG, "image/png", b"\x89PNG\r\n\x1a\n", "PNG"),
    (pb.OUTPUT_FORMAT_JPEG, pb.OUTPUT_FORMAT_JPEG, "image/jpeg", b"\xff\xd8\xff", "JPEG"),
    (pb.OUTPUT_FORMAT_WEBP, pb.OUTPUT_FORMAT_WEBP, "image/webp", b"RIFF", "WEBP"),
]


def opened(data: bytes) -> tuple[str | None, tuple[int, int]]:
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # decodes every byte: a truncated file fails here
        return img.format, img.size


@pytest.mark.parametrize(
    ("asked", "shown", "mime_type", "magic", "pil_format"), FORMATS, ids=[f[2] + f"-{f[0]}" for f in FORMATS]
)
def test_the_images_come_in_the_format_asked(
    stack, asked: pb.OutputFormat, shown: pb.OutputFormat, mime_type: str, magic: bytes, pil_format: str
) -> None:
    client = stub(stack)
    reply = client.SubmitJob(
        pb.SubmitJobRequest(
            model="tiny", prompt="a lighthouse", width=96, height=64, steps=2, num_images=2, output_format=asked
        )
    )
    job = wait_terminal(client, reply.job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert job.output_format == shown
    assert len(job.images) == 2
    for image in job.images:
        assert image.mime_type == mime_type
        assert image.data.startswith(magic)
        assert opened(image.data) == (pil_format, (96, 64))
    # Joining the stream after the end: the stored images, chunked, in the same format.
    _, streamed = collect_stream(client.StreamJob(pb.StreamJobRequest(job_id=reply.job_id)))
    assert [(i.mime_type, i.data) for i in streamed] == [(i.mime_type, i.data) for i in job.images]


def test_an_unknown_format_is_refused_by_name_and_nothing_stored(stack) -> None:
    client = stub(stack)
    before = count_jobs(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.SubmitJob(
            pb.SubmitJobRequest(model="tiny", prompt="p", width=64, height=64, output_format=cast(pb.OutputFormat, 7))
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [(v.field, "7" in v.description) for v in bad.field_violations] == [("output_format", True)]
    assert count_jobs(stack) == before
