"""Recovery through the whole stack, as a client sees it: deadlines, hard timeouts,
a worker whose attempts keep failing, a malformed dispatch, a dispatch that was
never published. Real processes; a registry with a model that cannot load and one
with a one-second timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

from services.bus.dispatch import DISPATCH_STREAM, dispatch_subject
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import nats_as_operator, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration

REGISTRY = """
[models.tiny]
source = "builtin:tiny"
family = "tiny"
dtype = "float32"
vram_mb = 16
max_width = 512
max_height = 512
default_width = 64
default_height = 64

[models.slow]
source = "builtin:tiny"
family = "tiny"
dtype = "float32"
vram_mb = 16
max_steps = 500
timeout_s = 1.0

[models.broken]
source = "/nonexistent/broken-model"
family = "tiny"
dtype = "float32"
vram_mb = 16
"""


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("recovery")
    registry = tmp / "registry.toml"
    registry.write_text(REGISTRY)
    s = make_stack(
        tmp / "stack",
        postgres,
        models_dir,
        model_registry=str(registry),
        heartbeat_interval_s=0.5,
        worker_stale_after_s=3.0,
        recovery_interval_s=0.25,
        redispatch_after_s=2.0,
        restart_backoff_s=0.2,
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def submit(client, model: str = "tiny", *, size: int = 64, steps: int = 4) -> str:
    request = pb.SubmitJobRequest(model=model, prompt="p", width=size, height=size, steps=steps)
    return client.SubmitJob(request).job_id


def test_job_still_queued_past_its_deadline_expires(stack: LocalStack) -> None:
    client = stub(stack)
    sampler = stack.services["sampler-0"]
    sampler.stop()  # drained and deregistered: nothing can run the job
    try:
        request = pb.SubmitJobRequest(model="tiny", prompt="p", width=64, height=64, steps=2)
        request.deadline.FromDatetime(datetime.now(UTC) + timedelta(seconds=1.5))
        job_id = client.SubmitJob(request).job_id
        job = wait_terminal(client, job_id, timeout=30)
    finally:
        sampler.start()
    assert job.status == pb.JOB_STATUS_EXPIRED
    assert job.attempts == 0 and not job.images and "deadline" in job.error
    assert client.GetStats(pb.GetStatsRequest()).totals.expired >= 1
    stack.wait_ready(60)


def test_job_past_its_timeout_is_stopped_retried_then_failed_naming_each_attempt(stack: LocalStack) -> None:
    client = stub(stack)
    job_id = submit(client, "slow", size=256, steps=400)
    job = wait_terminal(client, job_id, timeout=90)
    assert job.status == pb.JOB_STATUS_FAILED
    assert job.attempts == 3 and len(job.failed_attempts) == 3
    assert all(f.error == "ran past the 1s timeout of slow" for f in job.failed_attempts)
    assert job.error.startswith("failed after 3 attempts: attempt 1 on ")
    assert job.progress.step < 400
    # Timeouts are the job's size, not the worker's health: it is still there.
    assert all(w.restarts == 0 for w in client.GetStats(pb.GetStatsRequest()).workers)


def test_malformed_dispatch_is_terminated_and_the_worker_carries_on(stack: LocalStack) -> None:
    [worker_id] = stack.sampler_ids()

    async def publish_garbage() -> None:
        nc = await nats_as_operator(stack.settings.kernel)
        try:
            await nc.jetstream().publish(dispatch_subject(worker_id), b"{not json", stream=DISPATCH_STREAM)
        finally:
            await nc.close()

    async def messages_left() -> int:
        nc = await nats_as_operator(stack.settings.kernel)
        try:
            return (await nc.jetstream().stream_info(DISPATCH_STREAM)).state.messages
        finally:
            await nc.close()

    asyncio.run(publish_garbage())
    client = stub(stack)
    assert wait_terminal(client, submit(client)).status == pb.JOB_STATUS_SUCCEEDED
    wait_for(lambda: asyncio.run(messages_left()), lambda n: n == 0, timeout=10, what="the stream to empty")
    assert stack.services["sampler-0"].restarts == 0


def test_job_scheduled_but_never_published_is_published_again(stack: LocalStack) -> None:
    client = stub(stack)
    [worker_id] = stack.sampler_ids()
    # What a scheduler that died between its commit and its publish leaves behind.
    with psycopg.connect(stack.pg_url) as conn:
        row = conn.execute(
            "INSERT INTO jobs (id, status, lane, priority, model, prompt, negative_prompt, width, height, steps,"
            " guidance_scale, seed, num_images, created_at, attempt, worker_id, scheduled_at)"
            " VALUES (gen_random_uuid()::text, 'SCHEDULED', 'free', 0, 'tiny', 'p', '', 64, 64, 2, 7.5, 1, 1,"
            " now(), 1, %s, now() - interval '1 minute') RETURNING id",
            (worker_id,),
        ).fetchone()
    assert row is not None
    job_id = row[0]
    job = wait_terminal(client, job_id, timeout=60)
    assert job.status == pb.JOB_STATUS_SUCCEEDED and job.attempts == 1 and len(job.images) == 1


def test_worker_whose_attempts_keep_failing_goes_unhealthy_and_is_restarted(stack: LocalStack) -> None:
    """Three failing attempts in a row (one job's, on the one sampler) make the worker
    unhealthy; it exits and is restarted, and serves again."""
    client = stub(stack)
    sampler = stack.services["sampler-0"]
    before = sampler.restarts
    job = wait_terminal(client, submit(client, "broken"), timeout=90)
    assert job.status == pb.JOB_STATUS_FAILED
    assert job.error.startswith("failed after 3 attempts") and "ModelError" in job.error
    # The third failure is stored before the sampler exits for it.
    wait_for(lambda: sampler.restarts, lambda n: n > before, timeout=30, what="the sampler restarted")
    assert sampler.last_exit == "it exited with code 3"
    stack.wait_ready(60)
    [worker] = [w for w in client.GetStats(pb.GetStatsRequest()).workers if w.kind == "sampler"]
    assert worker.restarts == sampler.restarts and worker.state == "ready"
    assert wait_terminal(client, submit(client)).status == pb.JOB_STATUS_SUCCEEDED
