"""Cancelling a queued job stops it at once; a running one within a denoising step."""

from __future__ import annotations

import pytest

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration


def test_cancel_queued_job(stack) -> None:
    client = stub(stack)
    # With the scheduler stopped, the job cannot leave the queue.
    stack.services["scheduler"].stop()
    try:
        job_id = client.SubmitJob(
            pb.SubmitJobRequest(model="tiny", prompt="never", width=64, height=64, steps=2)
        ).job_id
        reply = client.CancelJob(pb.CancelJobRequest(job_id=job_id))
        assert reply.status == pb.JOB_STATUS_CANCELLED
    finally:
        stack.services["scheduler"].start()
    # A job submitted after it, once the scheduler is back, completes; the
    # cancelled one was never dispatched.
    after = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="after", width=64, height=64, steps=2))
    assert wait_terminal(client, after.job_id).status == pb.JOB_STATUS_SUCCEEDED
    job = client.GetJob(pb.GetJobRequest(job_id=job_id))
    assert job.status == pb.JOB_STATUS_CANCELLED
    assert job.attempts == 0 and not job.worker_id and not job.images


def test_cancel_running_job_stops_within_a_step(stack) -> None:
    client = stub(stack)
    total = 100
    job_id = client.SubmitJob(
        pb.SubmitJobRequest(model="tiny", prompt="long", width=512, height=512, steps=total)
    ).job_id
    seen = 0
    cancelled_at = None
    for event in client.StreamJob(pb.StreamJobRequest(job_id=job_id), timeout=120):
        if event.HasField("progress"):
            seen = event.progress.step
            if cancelled_at is None and seen >= 3:
                reply = client.CancelJob(pb.CancelJobRequest(job_id=job_id))
                assert reply.status == pb.JOB_STATUS_RUNNING  # flagged; the worker ends it
                cancelled_at = seen
        if event.HasField("terminal"):
            final = event.terminal
    assert cancelled_at is not None
    assert final.status == pb.JOB_STATUS_CANCELLED
    assert not final.images
    # The step running when the cancel arrived may finish; one more may already
    # have been in flight to this client when it sent the cancel.
    assert seen <= cancelled_at + 2, (seen, cancelled_at)
    job = wait_for(
        lambda: client.GetJob(pb.GetJobRequest(job_id=job_id)),
        lambda j: j.status == pb.JOB_STATUS_CANCELLED,
        timeout=10,
        what="cancelled",
    )
    assert job.progress.step < total


def test_cancel_finished_job_changes_nothing(stack) -> None:
    client = stub(stack)
    job_id = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="done", width=64, height=64, steps=2)).job_id
    assert wait_terminal(client, job_id).status == pb.JOB_STATUS_SUCCEEDED
    assert client.CancelJob(pb.CancelJobRequest(job_id=job_id)).status == pb.JOB_STATUS_SUCCEEDED
    assert len(client.GetJob(pb.GetJobRequest(job_id=job_id)).images) == 1
