"""The gateway holds no job state: restarted mid-job, the job still completes and
GetJob shows it."""

from __future__ import annotations

import pytest

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import png_size, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration


def test_gateway_killed_mid_job(stack) -> None:
    client = stub(stack)
    job_id = client.SubmitJob(
        pb.SubmitJobRequest(model="tiny", prompt="survive", width=256, height=256, steps=60)
    ).job_id
    wait_for(
        lambda: client.GetJob(pb.GetJobRequest(job_id=job_id)),
        lambda j: j.status == pb.JOB_STATUS_RUNNING,
        timeout=60,
        what="the job to start",
    )
    gateway = stack.services["gateway"]
    gateway.kill()
    gateway.start()
    stack.wait_ready(60, samplers=1)
    job = wait_terminal(stub(stack), job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert job.attempts == 1
    assert png_size(job.images[0].data) == (256, 256)
