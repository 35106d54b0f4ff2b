"""Warm-set planning: the scheduler plans which models a worker keeps loaded from
recent demand, and the worker drops a model nobody asks for while keeping the
one in demand warm."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from services.db.states import WorkerKind, WorkerStatus
from services.models.registry import DEFAULT_REGISTRY
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import stub, wait_for, wait_terminal, workers_heard

pytestmark = pytest.mark.integration

SMALL: dict[str, Any] = {"model": "tiny", "width": 64, "height": 64, "steps": 2}


def two_model_registry(path: Path) -> Path:
    """The shipped ``tiny`` table twice: as ``tiny`` and as ``tiny-b``."""
    tiny = tomllib.loads(DEFAULT_REGISTRY.read_text())["models"]["tiny"]
    assert tiny["source"] == "builtin:tiny" and tiny["family"] == "tiny"
    tiny.pop("default")  # one default image model: neither is
    lines = []
    for name in ("tiny", "tiny-b"):
        lines.append(f'[models."{name}"]')
        lines += [f"{key} = {json.dumps(value)}" for key, value in tiny.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def samplers(stack: LocalStack) -> list[dict[str, Any]]:
    """The ready samplers as presence has them: what each holds, and the plan the
    scheduler stored for it."""
    heard = workers_heard(stack.settings.kernel).values()
    return [
        {"id": w.id, "warm": list(w.warm_models), "planned": list(w.planned_models), "primary": w.primary_model}
        for w in heard
        if w.kind == WorkerKind.SAMPLER and w.status == WorkerStatus.READY and w.live
    ]


def test_planner_keeps_the_model_in_demand_and_drops_the_other(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    registry = two_model_registry(tmp_path / "registry.toml")
    stack = make_stack(
        tmp_path / "stack",
        postgres,
        models_dir,
        model_registry=str(registry),
        preload_models=("tiny", "tiny-b"),
        plan_interval_s=0.5,
        heartbeat_interval_s=0.2,
    )
    stack.start()
    try:
        client = stub(stack)
        # Both preloaded; with no demand yet the planner leaves warm sets alone.
        (worker,) = samplers(stack)
        assert sorted(worker["warm"]) == ["tiny", "tiny-b"], worker
        assert worker["planned"] == [], worker

        ids = [client.SubmitJob(pb.SubmitJobRequest(**SMALL, prompt=f"only tiny {i}")).job_id for i in range(3)]
        for job_id in ids:
            job = wait_terminal(client, job_id, timeout=60)
            assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error

        planned = wait_for(
            lambda: samplers(stack),
            lambda ws: len(ws) == 1 and "tiny" in ws[0]["planned"],
            timeout=15,
            what="a warm plan naming tiny",
        )[0]
        assert "tiny-b" not in planned["planned"], planned
        assert planned["primary"] == "tiny", planned

        dropped = wait_for(
            lambda: samplers(stack),
            lambda ws: len(ws) == 1 and "tiny-b" not in ws[0]["warm"],
            timeout=15,
            what="the worker to drop tiny-b",
        )[0]
        assert "tiny" in dropped["warm"], dropped
        assert dropped["id"] == worker["id"]
        models = {m.name: list(m.warm_on) for m in client.ListModels(pb.ListModelsRequest()).models}
        assert models == {"tiny": [worker["id"]], "tiny-b": []}, models
    finally:
        stack.stop()
