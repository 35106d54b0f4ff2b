"""The fault-injection suite: jobs run through the gRPC API while something breaks,
then one checker asserts that nothing was lost and nothing happened twice.
Real processes, a real PostgreSQL and real nats-servers; each scenario is short."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from services.embedded import EmbeddedNatsCluster, EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.stack import LocalStack
from tests.conftest import fresh_database
from tests.faults.harness import Load, check, fault_stack, now, stop_and_check_processes
from tests.helpers import wait_for

pytestmark = pytest.mark.faults


@pytest.fixture
def make(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> Iterator:
    """Builds and starts a stack (on the session's PostgreSQL unless told
    otherwise); stops it afterwards and checks that no process outlived it."""
    stacks: list[LocalStack] = []

    def build(*, own_postgres: bool = False, **overrides) -> LocalStack:
        url = "" if own_postgres else fresh_database(postgres)
        stack = fault_stack(tmp_path / f"stack{len(stacks)}", models_dir, database_url=url, **overrides)
        stacks.append(stack)
        stack.start()
        return stack

    yield build
    for stack in stacks:
        stop_and_check_processes(stack)


def running_job(load: Load, ids: list[str], *, min_step: int) -> pb.Job:
    """The first job seen RUNNING past ``min_step``: the moment to break something."""
    return wait_for(
        lambda: next(
            (j for j in map(load.get, ids) if j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= min_step), None
        ),
        lambda j: j is not None,
        timeout=60,
        what=f"a job running past step {min_step}",
    )


def sampler_of(stack: LocalStack, worker_id: str) -> str:
    return next(n for n, c in stack.services.items() if c.env.get("DARKROOM_WORKER_ID") == worker_id)


def test_sampler_killed_mid_sampling(make) -> None:
    stack = make()
    load = Load(stack)
    ids = load.submit(8)
    victim = running_job(load, ids, min_step=10)
    name = sampler_of(stack, victim.worker_id)
    stack.services[name].kill()
    fault_at = now()
    check("sampler `kill -9` mid-sampling", stack, load, fault_at=fault_at)
    job = load.get(victim.job_id)
    assert job.attempts >= 2 and job.starts == 2
    assert [f.worker_id for f in job.failed_attempts] == [victim.worker_id]
    stats = {w.worker_id: w for w in load.stub.GetStats(pb.GetStatsRequest()).workers}
    assert stats[victim.worker_id].restarts == 1 and stats[victim.worker_id].state == "ready"
