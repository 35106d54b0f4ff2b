"""Suspend and resume through the gRPC API, with real processes: a drain suspends
the job it samples at the next step and another GPU resumes it; urgent work
(a job with a latency target it would miss) preempts a long best-effort job,
which resumes afterwards; either way the image is
the one the job would have made uninterrupted, and every suspension and resumption
shows in GetJob and StreamJob."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import CHECKPOINTED_TINY, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration

LONG: dict[str, Any] = {"model": "tiny", "prompt": "a long one", "width": 256, "height": 256, "steps": 60, "seed": 11}
# The miniature with step caching: its checkpoints carry what it decides by.
CACHED_TINY = CHECKPOINTED_TINY.replace("[models.tiny]", "[models.tiny-cached]") + "step_cache = 0.1\n"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("suspend")
    registry = tmp / "registry.toml"
    registry.write_text(CHECKPOINTED_TINY + CACHED_TINY)
    s = make_stack(
        tmp / "stack",
        postgres,
        models_dir,
        model_registry=str(registry),
        # Latency classes decide preemption: paid work has a 0.5 s target, free
        # work none (best effort).
        lanes=("paid:10:120:0.5", "free:0:300"),
        preempt_for_targets=True,
        shutdown_grace_s=30.0,
        restart_backoff_s=0.2,
        samplers=2,
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def running_past(client, job_id: str, step: int) -> pb.Job:
    return wait_for(
        lambda: client.GetJob(pb.GetJobRequest(job_id=job_id)),
        lambda j: j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= step,
        timeout=120,
        what=f"{job_id} running past step {step}",
    )


def uninterrupted(client, request: dict) -> pb.Job:
    """The same job again, run without a stop: the image to compare with."""
    job_id = client.SubmitJob(pb.SubmitJobRequest(**{**request, "lane": "paid"})).job_id
    job = wait_terminal(client, job_id, timeout=300)
    assert job.status == pb.JOB_STATUS_SUCCEEDED and not job.suspensions, job
    return job


class Stream:
    """A StreamJob followed on its own thread, every event kept."""

    def __init__(self, client, job_id: str) -> None:
        self.events: list[pb.JobEvent] = []
        self._thread = threading.Thread(target=self._follow, args=(client, job_id), daemon=True)
        self._thread.start()

    def _follow(self, client, job_id: str) -> None:
        for event in client.StreamJob(pb.StreamJobRequest(job_id=job_id), timeout=300):
            self.events.append(event)

    def join(self) -> list[pb.JobEvent]:
        self._thread.join(300)
        assert not self._thread.is_alive()
        return self.events


def kinds(events: list[pb.JobEvent]) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def test_a_drain_suspends_at_the_next_step_and_another_gpu_resumes_with_the_same_image(stack: LocalStack) -> None:
    """Over 30 s: the job must be long enough (60 steps at 256 px) to be drained mid-way
    with time left to measure, and runs again uninterrupted to compare. Its model
    caches steps: resumed, it caches the steps it would have uninterrupted."""
    client = stub(stack)
    request = {**LONG, "model": "tiny-cached"}
    job_id = client.SubmitJob(pb.SubmitJobRequest(**request, lane="free")).job_id
    stream = Stream(client, job_id)
    seen = running_past(client, job_id, 3)
    draining = next(n for n, c in stack.services.items() if c.env.get("DARKROOM_WORKER_ID") == seen.worker_id)
    began = time.monotonic()
    stopper = threading.Thread(target=stack.services[draining].stop)
    stopper.start()
    queued = wait_for(
        lambda: client.GetJob(pb.GetJobRequest(job_id=job_id)),
        lambda j: len(j.suspensions) == 1,
        timeout=60,
        what="the suspension",
    )
    handed_back_s = time.monotonic() - began
    stopper.join(60)
    stack.services[draining].start()

    job = wait_terminal(client, job_id, timeout=300)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    [suspension] = job.suspensions
    assert suspension.reason == "drain" and suspension.worker_id == seen.worker_id
    assert seen.progress.step <= suspension.step < LONG["steps"]
    assert queued.checkpoint_step == suspension.step
    [resumption] = job.resumptions
    assert resumption.step == suspension.step and resumption.attempt == suspension.attempt + 1
    assert not job.failed_attempts, "a suspension costs no attempt"
    # Well within what the job had left to run (its resumed attempt's sampling):
    # about one step, not the job.
    left_s = job.stage_durations.sample_seconds
    assert handed_back_s < left_s, (handed_back_s, left_s)

    events = stream.join()
    assert kinds(events).count("suspended") == 1 and kinds(events).count("resumed") == 1
    after = kinds(events)[kinds(events).index("resumed") :]
    steps_after = [e.progress.step for e in events[len(events) - len(after) :] if e.HasField("progress")]
    assert steps_after and steps_after[0] == suspension.step + 1, "progress continues from the checkpoint"
    whole = uninterrupted(client, request)
    assert job.images[0].data == whole.images[0].data
    assert 0 < job.cached_steps == whole.cached_steps < LONG["steps"]


def test_an_urgent_job_preempts_long_best_effort_work_which_resumes_with_the_same_image(stack: LocalStack) -> None:
    """Over 30 s: a long job per sampler keeps every GPU busy while the urgent one preempts
    one of them, and the victim runs again uninterrupted to compare."""
    client = stub(stack)
    stack.wait_ready(60)  # both samplers, whatever the test before did to them
    samplers = len(stack.sampler_ids())
    # Of different sizes, so that they cannot share a batch (and a GPU): one of other
    # steps would join the first's batch at a step boundary.
    requests = [{**LONG, "width": LONG["width"] + 64 * i, "seed": 20 + i} for i in range(samplers)]
    longs = [client.SubmitJob(pb.SubmitJobRequest(**r, lane="free")).job_id for r in requests]
    running = [running_past(client, job_id, 3) for job_id in longs]
    assert len({j.worker_id for j in running}) == samplers, "every GPU is busy with best-effort work"

    submitted = time.time()
    urgent_id = client.SubmitJob(
        pb.SubmitJobRequest(model="tiny", prompt="urgent", width=64, height=64, steps=4, lane="paid")
    ).job_id
    urgent = wait_terminal(client, urgent_id, timeout=120)
    assert urgent.status == pb.JOB_STATUS_SUCCEEDED, urgent.error
    # The victim is known once the urgent job is done; the others, never suspended,
    # have nothing left to show and are cancelled rather than run to their end.
    suspended = [j for j in (client.GetJob(pb.GetJobRequest(job_id=i)) for i in longs) if j.suspensions]
    assert len(suspended) == 1, suspended
    for job_id in longs:
        if job_id != suspended[0].job_id:
            client.CancelJob(pb.CancelJobRequest(job_id=job_id))
    victim = wait_terminal(client, suspended[0].job_id, timeout=300)
    [suspension] = victim.suspensions
    assert suspension.reason == f"preempted for {urgent_id}"
    request = requests[longs.index(victim.job_id)]
    assert suspension.step < request["steps"]
    [resumption] = victim.resumptions
    assert resumption.step == suspension.step
    assert victim.status == pb.JOB_STATUS_SUCCEEDED and not victim.failed_attempts
    started = urgent.timings.started_time.ToDatetime().timestamp()
    # It started as soon as a GPU freed: within about one step of the job it
    # preempted, not after what that job had left.
    left_s = victim.stage_durations.sample_seconds  # the resumed attempt's: what it had left
    assert started - submitted < left_s, (started - submitted, left_s)
    assert suspension.time.ToDatetime().timestamp() <= started <= resumption.time.ToDatetime().timestamp()
    assert victim.images[0].data == uninterrupted(client, request).images[0].data
