"""A sampler whose outputs are garbage (a model with NaN weights stands in for a
corrupted CUDA context): its attempts fail, the jobs are retried on another GPU,
and after repeated bad outputs it reports itself unhealthy and its supervisor
restarts it."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import env_of, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration


def poisoned_registry(models_dir: Path, where: Path) -> Path:
    """A registry whose "tiny" is the tiny model with NaN output weights."""
    broken = where / "tiny-broken"
    shutil.copytree(models_dir / "tiny", broken)
    [weights] = (broken / "unet").glob("*.safetensors")
    tensors = load_file(weights)
    tensors["conv_out.weight"] = torch.full_like(tensors["conv_out.weight"], float("nan"))
    save_file(tensors, weights)
    tiny = ModelRegistry.load().get("tiny")
    lines = [f'[models.tiny]\nsource = "{broken}"']
    for key in ("family", "dtype", "max_width", "max_height", "default_width", "default_height"):
        lines.append(f"{key} = {json.dumps(getattr(tiny, key))}")
    registry = where / "broken.toml"
    registry.write_text("\n".join(lines) + "\n")
    return registry


def test_bad_outputs_fail_the_attempt_retry_elsewhere_and_restart_the_worker(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    """Over 30 s under load: a stack of two samplers of its own, one of which is restarted."""
    # No sampler of its own: the broken one comes first, the good one after.
    stack = make_stack(tmp_path / "stack", postgres, models_dir, unhealthy_after_failures=2, max_attempts=5)
    stack.cpu_workers = 0
    stack.start()
    try:
        client = stub(stack)
        stack.add(
            "sampler-broken",
            "sampler",
            env_of(worker_id="broken", model_registry=poisoned_registry(models_dir, tmp_path), preload_models=()),
        )
        stack.wait_ready(60, samplers=1)
        request: dict[str, Any] = dict(model="tiny", width=64, height=64, steps=3)
        with ThreadPoolExecutor(2) as pool:
            ids = [
                r.job_id
                for r in pool.map(client.SubmitJob, [pb.SubmitJobRequest(**request, prompt=f"p{i}") for i in range(2)])
            ]
        # Both fail on the broken sampler: two bad outputs in a row make it unfit.
        wait_for(
            lambda: [client.GetJob(pb.GetJobRequest(job_id=i)) for i in ids],
            lambda js: all(len(j.failed_attempts) >= 1 for j in js),
            timeout=60,
            what="an attempt of each job to fail",
        )
        stats = wait_for(
            lambda: {w.worker_id: w for w in client.GetStats(pb.GetStatsRequest()).workers},
            lambda ws: "broken" in ws and ws["broken"].restarts >= 1,
            timeout=60,
            what="the broken sampler to be restarted by its supervisor",
        )
        assert stats["broken"].restarts >= 1
        stack.add("sampler-good", "sampler", env_of(worker_id="good"))
        for job_id in ids:
            job = wait_terminal(client, job_id)
            assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
            assert job.worker_id == "good"
            assert job.failed_attempts, "the first attempt failed"
            for failure in job.failed_attempts:
                assert failure.worker_id == "broken"
                assert "BadOutput" in failure.error and "NaN" in failure.error
    finally:
        stack.stop()


def test_a_pinned_model_is_warmed_up_before_the_worker_reports_ready(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    """The warm-up is a real generation: a pinned model whose output is garbage
    keeps its worker from ever reporting ready (it fails, and is restarted).
    Over 30 s under load: a stack of its own whose sampler warms its pinned model up
    before it reports ready."""
    stack = make_stack(tmp_path / "stack", postgres, models_dir)
    stack.cpu_workers = 0
    stack.start()
    try:
        client = stub(stack)
        registry = str(poisoned_registry(models_dir, tmp_path))
        stack.add(
            "sampler-broken", "sampler", env_of(worker_id="broken", model_registry=registry, preload_models=("tiny",))
        )
        stats = wait_for(
            lambda: {w.worker_id: w for w in client.GetStats(pb.GetStatsRequest()).workers},
            lambda ws: "broken" in ws and ws["broken"].restarts >= 2,
            timeout=60,
            what="the broken sampler to fail its warm-up twice",
        )
        assert stats["broken"].state == "starting" and not stats["broken"].available
        assert str(stack.services["sampler-broken"].last_exit).startswith("it exited with code")
    finally:
        stack.stop()
