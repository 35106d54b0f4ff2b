"""The HTTP door's gateway client against a real gRPC server: a job whose stream
ends without its terminal event is read back with GetJob, outputs and all."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from http_api.gateway_client import Gateway
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc

# In the quick tier (pytest -m "not slow": docs/contributing.md).
pytestmark = pytest.mark.quick

PNG = b"\x89PNG\r\n\x1a\n-an-image"


class EndsEarly(image_generation_pb2_grpc.ImageGenerationServicer):
    """A gateway whose stream ends (a drain) before the job's terminal event."""

    async def StreamJob(self, request: pb.StreamJobRequest, context: Any) -> AsyncIterator[pb.JobEvent]:
        yield pb.JobEvent(job_id=request.job_id, progress=pb.Progress(step=4, total=4))

    async def GetJob(self, request: pb.GetJobRequest, context: Any) -> pb.Job:
        image = pb.Image(data=PNG, mime_type="image/png", width=64, height=64)
        return pb.Job(job_id=request.job_id, status=pb.JOB_STATUS_SUCCEEDED, images=[image])


async def test_a_stream_that_ends_without_its_terminal_event_keeps_the_jobs_outputs() -> None:
    server = grpc.aio.server()
    image_generation_pb2_grpc.add_ImageGenerationServicer_to_server(EndsEarly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            finished = await Gateway(channel).finished("job-1", "", timeout_s=10)
    finally:
        await server.stop(0)
    assert finished is not None and finished.job.status == pb.JOB_STATUS_SUCCEEDED
    assert [image.data for image in finished.outputs] == [PNG]
