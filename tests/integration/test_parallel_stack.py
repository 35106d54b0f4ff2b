"""A parallel model through the whole stack: `darkroom up` with two CPU samplers and
a registry of parallel twins forms one group of the two (``DARKROOM_GPU_GROUPS``'s
``auto``), which registers and heartbeats as one worker with its members; a job of
a parallel model runs across the group, and a job of a single-GPU model on its
leader alone; a video that tiles is decoded across the group.

About 40 CPU s: one stack (its two samplers form a group over gloo)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.db.states import WorkerKind
from services.models.parallel_miniatures import write_registry
from services.models.video_encoding import probe_video, read_frames
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import png_size, stub, wait_terminal, workers_heard

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("parallel")
    # Videos wider than a tile of Wan's VAE (256 px), which tile from 128x128 px a frame.
    registry = write_registry(tmp / "registry.toml", max_width=320)
    stack = make_stack(
        tmp / "stack",
        postgres,
        models_dir,
        model_registry=str(registry),
        samplers=2,
        decode_tile_above_pixels=128 * 128,
    )
    yield from running(stack)


def test_two_samplers_form_one_group_that_registers_as_one_worker(stack: LocalStack) -> None:
    [leader] = stack.sampler_ids()
    assert leader.endswith("-cpus0-1")
    members = [c.env for n, c in stack.services.items() if n.startswith("sampler")]
    assert sorted(env["DARKROOM_GROUP_RANK"] for env in members) == ["0", "1"]
    heard = workers_heard(stack.settings.kernel)
    samplers = [w for w in heard.values() if w.kind == WorkerKind.SAMPLER]
    assert [w.id for w in samplers] == [leader]
    group = samplers[0].telemetry["group"]
    assert group["size"] == 2 and group["members"] == ["cpu0", "cpu1"]
    assert "sequence=2" in group["shapes"] and "cfg=2" in group["shapes"]


@pytest.mark.parametrize("model", ["tiny-flux-sequence2", "tiny-cfg2", "tiny"])
def test_a_job_runs_on_the_group(stack: LocalStack, model: str) -> None:
    client = stub(stack)
    request = pb.SubmitJobRequest(model=model, prompt="a lighthouse", width=64, height=64, steps=4, seed=3)
    job = wait_terminal(client, client.SubmitJob(request).job_id, timeout=180)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert job.worker_id == stack.sampler_ids()[0]
    [image] = job.images
    assert png_size(image.data) == (64, 64)


def test_a_video_that_tiles_is_decoded_across_the_group(stack: LocalStack) -> None:
    """Its follower decodes its share of the tiles (it loads the VAE to), and the
    video comes back whole."""
    client = stub(stack)
    request = pb.SubmitJobRequest(
        model="tiny-wan-sequence2", prompt="waves", width=320, height=64, steps=2, frames=5, fps=8.0, seed=4
    )
    job = wait_terminal(client, client.SubmitJob(request).job_id, timeout=180)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    [video] = job.images
    info = probe_video(video.data)
    assert (info.frames, info.width, info.height) == (5, 320, 64)
    assert read_frames(video.data).std() > 1.0  # frames, not a blank
    follower = stack.services["sampler-1"]
    leader = stack.services["sampler-0"]
    assert "loaded VAE of tiny-wan-sequence2" in follower.log_tail(10**6), leader.log_tail(6000)
