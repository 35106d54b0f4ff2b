"""Backpressure: a submit whose estimated wait passes its lane's limit is refused
with RESOURCE_EXHAUSTED and a RetryInfo delay, before anything is stored; other
lanes, retries of accepted jobs and the accepted jobs themselves are unaffected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import count_jobs, stub, wait_terminal

pytestmark = pytest.mark.integration

FREE_LIMIT_S = 5.0
# 512x512, 100 steps: the registry's 30 ms a step makes each 3 s at speed 1.0, so
# the free lane's 5 s limit is passed after two of them are queued.
BIG: dict[str, Any] = {"model": "tiny", "width": 512, "height": 512, "steps": 100}
SMALL: dict[str, Any] = {"model": "tiny", "width": 64, "height": 64, "steps": 2}


def retry_delay_s(err: grpc.RpcError) -> float:
    status = rpc_status.from_call(err)
    assert status is not None, "no rich status details"
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToTimedelta().total_seconds()
    raise AssertionError(f"no RetryInfo in {status}")


def violations(err: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(err)
    assert status is not None, "no rich status details"
    fields: list[str] = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields


def test_full_lane_refuses_with_retry_info(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> None:
    """Over 30 s under load: a stack of its own whose lane is filled to its limit with
    queued work."""
    stack = make_stack(tmp_path, postgres, models_dir, lanes=("paid:10:1000", f"free:0:{FREE_LIMIT_S:g}"))
    stack.start()
    try:
        scheduler = stack.services["scheduler"]
        scheduler.stop()  # nothing leaves the queue: the estimated wait only grows
        client = stub(stack)

        accepted: list[tuple[str, pb.SubmitJobResponse]] = []
        refusal: grpc.RpcError | None = None
        for i in range(10):
            before = count_jobs(stack)
            key = f"big-{i}"
            try:
                reply = client.SubmitJob(pb.SubmitJobRequest(**BIG, prompt=key, lane="free", idempotency_key=key))
            except grpc.RpcError as err:
                refusal = err
                assert count_jobs(stack) == before, "a refused submit stored a job"
                break
            accepted.append((key, reply))
        assert refusal is not None, "the free lane never refused a submit"
        # 0 s, then 3 s of queued work ahead fit under 5 s; 6 s does not.
        assert len(accepted) >= 2, [r for _, r in accepted]

        for _, reply in accepted:
            assert reply.status == pb.JOB_STATUS_QUEUED and not reply.deduplicated
            assert reply.HasField("estimated_start_time") and reply.HasField("estimated_finish_time")
            start = reply.estimated_start_time.ToDatetime()
            assert reply.estimated_finish_time.ToDatetime() > start
        starts = [r.estimated_start_time.ToDatetime() for _, r in accepted]
        assert starts == sorted(starts) and starts[-1] > starts[0], starts

        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
        assert "free" in (refusal.details() or ""), refusal.details()
        delay = retry_delay_s(refusal)
        assert delay > FREE_LIMIT_S, delay

        # The paid lane has nothing queued ahead of it: accepted at the same moment.
        before = count_jobs(stack)
        paid = client.SubmitJob(pb.SubmitJobRequest(**SMALL, prompt="paid", lane="paid"))
        assert paid.status == pb.JOB_STATUS_QUEUED and not paid.deduplicated
        assert paid.HasField("estimated_start_time")
        assert count_jobs(stack) == before + 1

        # An unknown lane is a bad request, not backpressure.
        with pytest.raises(grpc.RpcError) as bad:
            client.SubmitJob(pb.SubmitJobRequest(**SMALL, prompt="x", lane="vip"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violations(bad.value) == ["lane"]

        # The free lane is still full, yet a retry of an accepted job gets its answer.
        with pytest.raises(grpc.RpcError) as again:
            client.SubmitJob(pb.SubmitJobRequest(**BIG, prompt="again", lane="free"))
        assert again.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        key, first = accepted[0]
        before = count_jobs(stack)
        retry = client.SubmitJob(pb.SubmitJobRequest(**BIG, prompt=key, lane="free", idempotency_key=key))
        assert retry.job_id == first.job_id and retry.deduplicated
        assert count_jobs(stack) == before

        # A big job takes minutes on a CPU: they are cancelled while queued, which
        # frees the free lane (a small job is accepted again), and everything
        # still accepted completes once the scheduler is back.
        for _, reply in accepted:
            assert client.CancelJob(pb.CancelJobRequest(job_id=reply.job_id)).status == pb.JOB_STATUS_CANCELLED
        small = client.SubmitJob(pb.SubmitJobRequest(**SMALL, prompt="small", lane="free"))
        assert small.status == pb.JOB_STATUS_QUEUED and not small.deduplicated
        scheduler.start()
        for job_id in (paid.job_id, small.job_id):
            job = wait_terminal(client, job_id, timeout=60)
            assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
            assert len(job.images) == 1
        for _, reply in accepted:
            job = client.GetJob(pb.GetJobRequest(job_id=reply.job_id))
            assert job.status == pb.JOB_STATUS_CANCELLED and job.attempts == 0
    finally:
        stack.stop()
