"""Capability tags through the real processes: a sampler serves only the kinds of
work it advertises (DARKROOM_CAPABILITIES restricts it); a job whose capability no
live sampler serves stays queued, saying what it waits for, and runs once such a
sampler joins; ListModels and GetStats show the capabilities."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import env_of, png_size, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration


def small_png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (30, 160, 90)).save(out, format="PNG")
    return out.getvalue()


def test_a_job_no_sampler_serves_waits_saying_why_and_runs_once_one_joins(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    """Over 30 s under load: a stack of its own, and a second sampler started while the job
    waits."""
    stack = make_stack(tmp_path, postgres, models_dir, capabilities=("image",))
    stack.start()
    try:
        client = stub(stack)
        [sampler] = [w for w in client.GetStats(pb.GetStatsRequest()).workers if w.kind == "sampler"]
        assert list(sampler.capabilities) == ["image"]
        models = client.ListModels(pb.ListModelsRequest()).models
        listed = [(m.name, m.capability, m.is_default) for m in models]
        # Each capability's default first, then the rest of it by name: images, upscales, videos.
        images = sorted(s.name for s in ModelRegistry.load().models.values() if s.capability == "image")
        assert listed == [
            ("tiny", "image", True),
            *((name, "image", False) for name in images if name != "tiny"),
            ("tiny-upscaler", "upscale", True),
            ("tiny-wan", "video", True),
            ("tiny-wan22", "video", False),
        ]
        served = {m.name: list(m.served_by) for m in models}
        assert served == {
            **{name: [sampler.worker_id] for name in images},
            "tiny-upscaler": [],
            "tiny-wan": [],
            "tiny-wan22": [],
        }

        request = pb.SubmitJobRequest(model="tiny-upscaler", prompt="sharp", image=small_png(), steps=2)
        job_id = client.SubmitJob(request).job_id
        waiting = wait_for(
            lambda: client.GetJob(pb.GetJobRequest(job_id=job_id)),
            lambda j: j.waiting_for == "upscale",
            timeout=30,
            what="the job to say what it waits for",
        )
        assert waiting.status == pb.JOB_STATUS_QUEUED
        assert waiting.routing.reason == "no live sampler serves upscale"
        # An image job is not held up by it.
        image = wait_terminal(client, client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="a", steps=2)).job_id)
        assert image.status == pb.JOB_STATUS_SUCCEEDED

        stack.add(
            "sampler-upscale",
            "sampler",
            {"DARKROOM_DEVICE": "cpu", "DARKROOM_WORKER_ID": "upscaler-0", **env_of(capabilities=("upscale",))},
        )
        job = wait_terminal(client, job_id)
        assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
        assert job.worker_id == "upscaler-0" and job.waiting_for == ""
        assert png_size(job.images[0].data) == (128, 128)
    finally:
        stack.stop()
