"""Durations are learned from completed jobs, stored, and used for the estimates a
submit returns, also by a gateway started after they were learned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from scheduler.estimates import REFERENCE_PIXELS
from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration

W, H, STEPS, N = 128, 128, 4, 1
JOB: dict[str, Any] = {"model": "tiny", "width": W, "height": H, "steps": STEPS, "num_images": N}
RUNS = 3


def learned(stack: LocalStack) -> dict[tuple[str, str], tuple[float, int]]:
    url = stack.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT kind, key, mean, count FROM learned_estimates").fetchall()
    return {(kind, key): (float(mean), int(count)) for kind, key, mean, count in rows}


def test_learned_duration_survives_gateway_restart(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    stack = make_stack(tmp_path, postgres, models_dir)
    stack.start()
    try:
        client = stub(stack)
        assert learned(stack) == {}, "a fresh database has nothing learned"
        workers = set()
        for i in range(RUNS):
            job = wait_terminal(client, client.SubmitJob(pb.SubmitJobRequest(**JOB, prompt=f"learn {i}")).job_id)
            assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
            workers.add(job.worker_id)
        assert len(workers) == 1
        (worker_id,) = workers

        shape_key = f"tiny|{W * H}|{STEPS}|{N}"
        # The worker records the duration with the result. The stack pins the model,
        # so the worker warmed it up with a generation of its own before it took
        # work: even the first job ran warm and is learned.
        learned_runs = RUNS
        table = wait_for(
            lambda: learned(stack),
            lambda t: t.get(("shape", shape_key), (0.0, 0))[1] >= learned_runs and ("speed", worker_id) in t,
            timeout=15,
            what=f"{learned_runs} observations of {shape_key}",
        )
        mean, count = table[("shape", shape_key)]
        assert count == learned_runs
        assert mean > 0
        speed_mean, speed_count = table[("speed", worker_id)]
        assert speed_count == learned_runs and speed_mean > 0

        gateway = stack.services["gateway"]
        gateway.stop()
        assert not gateway.running
        gateway.start()
        stack.wait_ready(60, samplers=1)
        # The new gateway estimates from the samplers it has heard of: once it has.
        wait_for(
            lambda: stub(stack).GetStats(pb.GetStatsRequest()).workers,
            lambda workers: any(w.worker_id == worker_id for w in workers),
            timeout=30,
            what=f"the restarted gateway hearing of {worker_id}",
        )

        reply = stub(stack).SubmitJob(pb.SubmitJobRequest(**JOB, prompt="estimated"))
        assert reply.HasField("estimated_start_time") and reply.HasField("estimated_finish_time")
        run_s = (reply.estimated_finish_time.ToDatetime() - reply.estimated_start_time.ToDatetime()).total_seconds()
        # One worker: its speed is normalized to 1.0, so the estimate is the shape's mean.
        assert run_s == pytest.approx(mean, rel=1e-3), (run_s, mean)
        step_s = ModelRegistry.load().get("tiny").step_s_512
        default_s = step_s * STEPS * (W * H / REFERENCE_PIXELS) * N
        assert run_s != pytest.approx(default_s, rel=1e-2), (run_s, default_s)
        assert wait_terminal(stub(stack), reply.job_id).status == pb.JOB_STATUS_SUCCEEDED
    finally:
        stack.stop()
