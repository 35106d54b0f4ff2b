"""Services ride out what they depend on being away: NATS down for longer than a
blip, no decoder at all, a worker gone for good."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from services.bus.dispatch import DISPATCH_STREAM
from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import nats_as_operator, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration


def test_services_wait_out_nats_being_away(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> None:
    """Over 30 s: NATS is kept away for 12 s on purpose (several reconnect cycles), then
    every service must come back."""
    stack = make_stack(tmp_path, postgres, models_dir, heartbeat_interval_s=0.5)
    try:
        stack.start()
        assert stack.nats is not None
        pids = {name: child.pid for name, child in stack.services.items()}
        stack.nats.kill()
        client = stub(stack)
        # Accepted while NATS is away: the job waits in PostgreSQL.
        job_id = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="p", width=64, height=64, steps=2)).job_id
        time.sleep(12)  # several reconnect cycles: long enough for a service that gives up to have exited
        assert {name: child.pid for name, child in stack.services.items()} == pids, "a service exited"
        assert all(child.restarts == 0 for child in stack.services.values())
        stack.nats.start()
        job = wait_terminal(client, job_id, timeout=60)
        assert job.status == pb.JOB_STATUS_SUCCEEDED
    finally:
        stack.stop()


def test_sampler_decodes_locally_when_no_decoder_runs(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    stack = make_stack(tmp_path, postgres, models_dir, local_decode_fallback=True)
    stack.decoders = 0
    try:
        stack.start()
        client = stub(stack)
        job_id = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="p", width=96, height=64, steps=2)).job_id
        job = wait_terminal(client, job_id, timeout=60)
        assert job.status == pb.JOB_STATUS_SUCCEEDED and job.attempts == 1
        assert (job.images[0].width, job.images[0].height) == (96, 64)
    finally:
        stack.stop()


def test_worker_gone_for_good_is_forgotten_and_can_come_back(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    stack = make_stack(tmp_path, postgres, models_dir, worker_forget_after_s=2.0, heartbeat_interval_s=0.5)
    try:
        stack.start()
        [worker_id] = stack.sampler_ids()
        sampler = stack.services["sampler-0"]
        sampler.stop()

        def row_exists() -> bool:
            with psycopg.connect(stack.pg_url) as conn:
                return conn.execute("SELECT 1 FROM workers WHERE id = %s", (worker_id,)).fetchone() is not None

        wait_for(row_exists, lambda exists: not exists, timeout=30, what="the worker's row to be forgotten")

        async def consumers() -> set[str]:
            nc = await nats_as_operator(stack.settings.kernel)
            try:
                return {c.name for c in await nc.jetstream().consumers_info(DISPATCH_STREAM)}
            finally:
                await nc.close()

        assert f"worker-{worker_id}" not in asyncio.run(consumers())
        sampler.start()
        stack.wait_ready(60)
        client = stub(stack)
        job_id = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="p", width=64, height=64, steps=2)).job_id
        assert wait_terminal(client, job_id).status == pb.JOB_STATUS_SUCCEEDED
    finally:
        stack.stop()
