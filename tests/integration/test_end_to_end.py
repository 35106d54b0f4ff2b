"""A client submits through the real stack (nats-server, PostgreSQL, gateway,
scheduler, sampler and VAE worker, each its own process) and gets a real PNG."""

from __future__ import annotations

import pytest

from services.rpc.client import collect_stream
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import png_size, stub, wait_terminal

pytestmark = [pytest.mark.integration, pytest.mark.quick]


def test_submit_and_poll_returns_png_of_requested_size(stack) -> None:
    client = stub(stack)
    reply = client.SubmitJob(
        pb.SubmitJobRequest(model="tiny", prompt="a lighthouse", width=96, height=64, steps=4, seed=7)
    )
    assert reply.job_id
    assert reply.status == pb.JOB_STATUS_QUEUED
    assert reply.estimated_finish_time.ToDatetime() >= reply.estimated_start_time.ToDatetime()
    job = wait_terminal(client, reply.job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert len(job.images) == 1
    image = job.images[0]
    assert image.mime_type == "image/png"
    assert (image.width, image.height) == (96, 64)
    assert png_size(image.data) == (96, 64)
    assert image.seed == 7
    assert job.attempts == 1
    assert job.worker_id and job.routing.worker_id == job.worker_id
    assert job.routing.candidates and job.routing.reason
    assert job.progress.step == job.progress.total == 4
    t = job.timings
    times = [
        t.created_time,
        t.scheduled_time,
        t.dispatched_time,
        t.started_time,
        t.decoding_time,
        t.decoded_time,
        t.finished_time,
    ]
    assert all(ts.ToNanoseconds() > 0 for ts in times)
    assert [ts.ToDatetime() for ts in times] == sorted(ts.ToDatetime() for ts in times)
    # Each stage's duration, from those times: they add up to the whole.
    d = job.stage_durations
    stages = [d.queue_seconds, d.schedule_seconds, d.dispatch_seconds, d.sample_seconds, d.decode_seconds]
    assert all(d.HasField(f.name) for f in d.DESCRIPTOR.fields)
    assert d.sample_seconds > 0 and d.total_seconds > 0
    assert abs(sum([*stages, d.store_seconds]) - d.total_seconds) < 1e-6
    assert abs(d.total_seconds - (t.finished_time.ToNanoseconds() - t.created_time.ToNanoseconds()) / 1e9) < 1e-6


def test_stream_shows_status_progress_then_image_chunks_then_terminal(stack) -> None:
    client = stub(stack)
    reply = client.SubmitJob(
        pb.SubmitJobRequest(model="tiny", prompt="a fox", width=128, height=128, steps=8, num_images=2, seed=100)
    )
    events = list(client.StreamJob(pb.StreamJobRequest(job_id=reply.job_id), timeout=120))
    kinds = [e.WhichOneof("event") for e in events]
    statuses = [e.status for e in events if e.HasField("status")]
    steps = [e.progress.step for e in events if e.HasField("progress")]
    # From the state it had when the stream began (a fast scheduler may have placed it
    # already), each status once, in the order the job went through them.
    life = [
        pb.JOB_STATUS_QUEUED,
        pb.JOB_STATUS_SCHEDULED,
        pb.JOB_STATUS_RUNNING,
        pb.JOB_STATUS_DECODING,
        pb.JOB_STATUS_SUCCEEDED,
    ]
    assert statuses == sorted(statuses, key=life.index) and len(set(statuses)) == len(statuses), statuses
    assert pb.JOB_STATUS_RUNNING in statuses and statuses[-1] == pb.JOB_STATUS_SUCCEEDED
    assert steps, "no per-step progress events"
    assert steps == sorted(steps) and steps[-1] == 8
    assert kinds[-1] == "terminal"
    first_chunk = kinds.index("image_chunk")
    assert kinds.index("progress") < first_chunk
    assert all(k == "image_chunk" for k in kinds[first_chunk:-1])
    job, images = collect_stream(iter(events))
    assert job.status == pb.JOB_STATUS_SUCCEEDED
    assert [i.seed for i in images] == [100, 101]
    assert [png_size(i.data) for i in images] == [(128, 128), (128, 128)]
    assert images[0].data != images[1].data  # different seeds, different noise


def test_stream_joined_after_the_end_still_yields_result(stack) -> None:
    client = stub(stack)
    reply = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="late", width=64, height=64, steps=2))
    done = wait_terminal(client, reply.job_id)
    job, images = collect_stream(client.StreamJob(pb.StreamJobRequest(job_id=reply.job_id), timeout=30))
    assert job.status == pb.JOB_STATUS_SUCCEEDED
    assert len(images) == 1 and images[0].data == done.images[0].data


def test_same_seed_gives_same_image(stack) -> None:
    client = stub(stack)
    ids = [
        client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="same", width=64, height=64, steps=3, seed=42)).job_id
        for _ in range(2)
    ]
    a, b = (wait_terminal(client, i) for i in ids)
    assert a.images[0].data == b.images[0].data


def test_idempotency_key_returns_the_same_job(stack) -> None:
    client = stub(stack)
    request = pb.SubmitJobRequest(model="tiny", prompt="once", width=64, height=64, steps=2, idempotency_key="k-1")
    first = client.SubmitJob(request)
    second = client.SubmitJob(request)
    assert second.job_id == first.job_id
    assert second.deduplicated and not first.deduplicated


def test_unknown_job_is_not_found(stack) -> None:
    import grpc

    client = stub(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.GetJob(pb.GetJobRequest(job_id="00000000-0000-0000-0000-000000000000"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_list_models_and_stats(stack) -> None:
    client = stub(stack)
    models = client.ListModels(pb.ListModelsRequest()).models
    tiny = next(m for m in models if m.name == "tiny")
    assert tiny.warm_on, "the tiny model is preloaded on the worker"
    stats = client.GetStats(pb.GetStatsRequest())
    assert sorted(w.kind for w in stats.workers) == ["decoder", "sampler"]
    assert all(w.available for w in stats.workers)
    assert stats.totals.requests >= stats.totals.completed
    # No GPU here: every worker says where its figures would come from, and why not.
    for worker in stats.workers:
        assert worker.telemetry_source == "none" and worker.telemetry_note == "a CPU worker"
        assert not worker.throttle_reasons and worker.sm_clock_mhz == 0
