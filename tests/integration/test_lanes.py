"""Priority lanes: a paid job submitted after free ones runs before them, and every
placement records where it went, why, and what else was considered."""

from __future__ import annotations

import itertools
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import stub, wait_terminal

pytestmark = pytest.mark.integration

SMALL: dict[str, Any] = {"model": "tiny", "width": 64, "height": 64, "steps": 2}


def test_paid_job_overtakes_queued_free_jobs(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> None:
    # No backlog: a worker holds only what it runs, so the scheduler's lane order
    # decides which queued job runs first (jobs of different steps may still share a
    # batch: continuous batching joins them at a step's end).
    stack = make_stack(tmp_path, postgres, models_dir, worker_backlog=0)
    stack.start()
    try:
        scheduler = stack.services["scheduler"]
        scheduler.stop()
        client = stub(stack)
        free = [
            client.SubmitJob(pb.SubmitJobRequest(**{**SMALL, "steps": 3 + i}, prompt=f"free {i}", lane="free")).job_id
            for i in range(4)
        ]
        paid = client.SubmitJob(pb.SubmitJobRequest(**SMALL, prompt="paid", lane="paid")).job_id
        scheduler.start()

        jobs = {job_id: wait_terminal(client, job_id, timeout=60) for job_id in [*free, paid]}
        for job_id, job in jobs.items():
            assert job.status == pb.JOB_STATUS_SUCCEEDED, (job_id, job.error)
            assert job.lane == ("paid" if job_id == paid else "free")
            assert job.worker_id and job.routing.worker_id == job.worker_id
            assert job.routing.reason
            assert job.routing.candidates
            assert any(c.worker_id == job.worker_id and c.eligible for c in job.routing.candidates)

        def started(job_id: str):
            return jobs[job_id].timings.started_time.ToDatetime()

        def created(job_id: str):
            return jobs[job_id].timings.created_time.ToDatetime()

        assert all(created(f) < created(paid) for f in free)
        late = [f for f in free if started(f) <= started(paid)]
        assert not late, f"free jobs {late} started no later than the paid job submitted after them"
        # Within a lane, first come first served. Jobs that sampled in one batch began
        # together: their start is that batch's, to within the microsecond its rounding
        # leaves, and their order among themselves is not a lane's to keep.
        together = timedelta(milliseconds=1)
        assert all(started(a) <= started(b) + together for a, b in itertools.pairwise(free)), [started(f) for f in free]
    finally:
        stack.stop()
