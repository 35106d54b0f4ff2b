"""Batching through the gRPC API, on real processes: compatible jobs submitted
together run as one batch on the sampler, each gets the image it would get alone,
a job submitted while a batch runs joins it at a step boundary (continuous
batching) and still gets its solo image, and a cancelled member leaves the batch
without stopping the others."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import stub, wait_for, wait_terminal, workers_heard

pytestmark = pytest.mark.integration

SHAPE: dict[str, Any] = dict(model="tiny", width=64, height=64, steps=8, guidance_scale=7.5)


@pytest.fixture(scope="module")
def batching_stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    # A generous wait, so that jobs submitted together always meet on the sampler.
    stack = make_stack(tmp_path_factory.mktemp("batching"), postgres, models_dir, batch_wait_ms=1500.0)
    stack.start()
    yield stack
    stack.stop()


def submit_together(client, requests: list[pb.SubmitJobRequest]) -> list[str]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return [r.job_id for r in pool.map(client.SubmitJob, requests)]


def test_compatible_jobs_run_as_one_batch_and_each_gets_its_solo_image(batching_stack: LocalStack) -> None:
    client = stub(batching_stack)
    requests = [
        pb.SubmitJobRequest(**SHAPE, prompt="a red door", seed=11),
        pb.SubmitJobRequest(**SHAPE, prompt="a blue door", seed=12, num_images=2),
        pb.SubmitJobRequest(**SHAPE, prompt="a red door", seed=13, negative_prompt="blur"),
    ]
    odd = pb.SubmitJobRequest(**{**SHAPE, "width": 96}, prompt="another size", seed=14)
    ids = submit_together(client, [*requests, odd])
    jobs = [wait_terminal(client, job_id) for job_id in ids]
    assert [j.status for j in jobs] == [pb.JOB_STATUS_SUCCEEDED] * 4, [j.error for j in jobs]
    assert [j.batch_images for j in jobs[:3]] == [4, 4, 4]  # 1 + 2 + 1 images, one batch
    assert jobs[3].batch_images == 1  # another size shares no network call: it runs on its own
    assert [j.joined_batch_images for j in jobs] == [0] * 4

    # Alone, one after the other, each job gives exactly the same image bytes.
    for request, batched in zip(requests, jobs[:3], strict=True):
        solo = wait_terminal(client, client.SubmitJob(request).job_id)
        assert solo.status == pb.JOB_STATUS_SUCCEEDED
        assert solo.batch_images == (request.num_images or 1)
        assert [i.data for i in solo.images] == [i.data for i in batched.images]


def test_a_job_submitted_while_a_batch_of_four_runs_joins_it_and_gets_its_solo_image(
    batching_stack: LocalStack,
) -> None:
    client = stub(batching_stack)
    long: dict[str, Any] = {**SHAPE, "width": 128, "height": 128, "steps": 60}
    ids = submit_together(client, [pb.SubmitJobRequest(**long, prompt=f"runner {i}", seed=20 + i) for i in range(4)])
    wait_for(
        lambda: [client.GetJob(pb.GetJobRequest(job_id=i)) for i in ids],
        lambda js: all(j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= 2 for j in js),
        timeout=60,
        what="the four jobs running together",
    )
    # The sampler's heartbeat tells the scheduler the batch has room for that model and size.
    kernel = batching_stack.settings.kernel
    wait_for(
        lambda: [s for w in workers_heard(kernel).values() if w.kind == "sampler" for s in w.telemetry["open_seats"]],
        lambda seats: any(
            (s["model"], s["width"], s["height"], s["rows"]) == ("tiny", 128, 128, 4) and s["free_rows"] > 0
            for s in seats
        ),
        timeout=30,
        what="the running batch's open seats in presence",
    )
    # Its own steps, guidance and seed: only the model and size must match.
    late = pb.SubmitJobRequest(**{**long, "steps": 12, "guidance_scale": 5.0}, prompt="a late fox", seed=99)
    joined = wait_terminal(client, client.SubmitJob(late).job_id)
    assert joined.status == pb.JOB_STATUS_SUCCEEDED, joined.error
    assert joined.joined_batch_images == 4, "it joined the running batch of four"
    # The scheduler placed it there for the seat the heartbeat offered.
    chosen = [c for c in joined.routing.candidates if c.worker_id == joined.routing.worker_id]
    assert [c.note for c in chosen] == ["joins its running batch of 4 at the next step"], joined.routing
    assert joined.batch_images == 5
    batch = [wait_terminal(client, job_id) for job_id in ids]
    assert [j.status for j in batch] == [pb.JOB_STATUS_SUCCEEDED] * 4
    assert [j.joined_batch_images for j in batch] == [0] * 4
    # It left as its 12 steps were done, while the batch went on with its 60.
    left = joined.timings.decoding_time.ToDatetime()
    assert all(left < j.timings.decoding_time.ToDatetime() for j in batch)
    # Its sampling began when it joined, after theirs.
    assert all(joined.timings.started_time.ToDatetime() > j.timings.started_time.ToDatetime() for j in batch)

    solo = wait_terminal(client, client.SubmitJob(late).job_id)
    assert solo.status == pb.JOB_STATUS_SUCCEEDED
    assert (solo.batch_images, solo.joined_batch_images) == (1, 0)
    assert [i.data for i in solo.images] == [i.data for i in joined.images]


def test_a_cancelled_member_leaves_and_the_rest_of_the_batch_finishes(batching_stack: LocalStack) -> None:
    client = stub(batching_stack)
    long: dict[str, Any] = {**SHAPE, "width": 128, "height": 128, "steps": 40}
    ids = submit_together(client, [pb.SubmitJobRequest(**long, prompt=f"member {i}", seed=i) for i in range(3)])
    wait_for(
        lambda: [client.GetJob(pb.GetJobRequest(job_id=i)) for i in ids],
        lambda js: all(j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= 2 for j in js),
        timeout=60,
        what="the three jobs to be running together",
    )
    client.CancelJob(pb.CancelJobRequest(job_id=ids[1]))
    cancelled = wait_terminal(client, ids[1])
    assert cancelled.status == pb.JOB_STATUS_CANCELLED
    assert cancelled.progress.step < long["steps"]
    for job_id in (ids[0], ids[2]):
        job = wait_terminal(client, job_id)
        assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
        assert len(job.images) == 1
        # Images beside them over their steps, on average: the cancelled job left early.
        assert job.batch_images == 2
