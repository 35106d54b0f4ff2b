"""Edits that cannot knock samplers out (issue 55), on real processes (its sampler
unhealthy after a single failure of its own): an input image past its model's
bounds (a 4096x1 one, an extreme aspect), for every family that takes one and
whatever size is asked, and a Qwen-Image-Edit prompt longer than its text encoder
reads whole, are refused at the door, gRPC's and HTTP's, naming the field, and
nothing is stored. A job stored by a gateway that did not bound them (an older one)
fails at the sampler as its own fault: one attempt, never retried, and the sampler
stays healthy and serves the next edit."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image

from gateway.validation import validate_submit
from services.db.repository import Repository
from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import count_jobs, png_size, stub, wait_terminal

pytestmark = pytest.mark.integration

EDIT = "tiny-qwen-image-edit"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("edit-bounds")
    yield from running(make_stack(tmp, postgres, models_dir, http=True, unhealthy_after_failures=1))


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="PNG")
    return out.getvalue()


def violations(err: grpc.RpcError) -> dict[str, str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no rich status details"
    found = {}
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            found.update({v.field: v.description for v in bad.field_violations})
    return found


REFUSED: list[tuple[dict[str, Any], set[str]]] = [
    (dict(model=EDIT, image=png(4096, 1), width=128, height=128), {"image"}),
    (dict(model=EDIT, image=png(1040, 256)), {"image"}),  # 4.06:1, past Qwen-Image-Edit's 4:1
    (dict(model="tiny", image=png(4096, 8), mask=png(4096, 8, "L"), width=512, height=512), {"image", "mask"}),
    (dict(model="tiny-flux-kontext", image=png(1024, 16), width=512, height=512), {"image"}),
    (dict(model="tiny-sd3", image=png(2048, 64), strength=0.5), {"image"}),
    (dict(model="tiny-upscaler", image=png(8, 256)), {"image"}),
    (dict(model=EDIT, image=png(64, 64), prompt="x" * 1025), {"prompt"}),
]


@pytest.mark.parametrize(("fields", "named"), REFUSED, ids=[f"{f['model']}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_an_input_past_its_models_bounds_is_refused_at_the_door_and_nothing_is_stored(
    stack: LocalStack, fields: dict[str, Any], named: set[str]
) -> None:
    before = count_jobs(stack)
    with pytest.raises(grpc.RpcError) as refused:
        stub(stack).SubmitJob(pb.SubmitJobRequest(**{"prompt": "make it night", "steps": 2, **fields}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(violations(refused.value)) == named, violations(refused.value)
    assert count_jobs(stack) == before


@pytest.mark.parametrize(
    ("image", "form", "param"),
    [(png(4096, 1), {"size": "128x128"}, "image"), (png(64, 64), {"prompt": "é" * 513}, "prompt")],
    ids=["a 4096x1 image at a size given", "a prompt of 1026 bytes"],
)
def test_the_http_door_refuses_them_naming_the_param(
    stack: LocalStack, image: bytes, form: dict[str, str], param: str
) -> None:
    before = count_jobs(stack)
    answer = httpx.post(
        f"{stack.http_url}/v1/images/edits",
        files={"image": ("in.png", image)},
        data={"model": EDIT, "prompt": "make it night", "steps": "2", **form},
        timeout=60,
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert count_jobs(stack) == before


def stored_by_an_older_gateway(stack: LocalStack, model: str, image: bytes) -> str:
    """The job an older gateway stored: checked as today's gateway checks a job, but
    for its input's sides and aspect."""
    spec = ModelRegistry.load().get(model)
    unbounded = ModelRegistry({model: replace(spec, min_input_side=1, max_input_aspect=float("inf"))})
    request = pb.SubmitJobRequest(model=model, prompt="make it night", image=image, width=64, height=64, steps=2)
    new = validate_submit(request, unbounded, max_prompt_chars=2000, now=datetime.now(UTC))

    async def store() -> None:
        repo = Repository(stack.settings.kernel.database_url, pool_size=1)
        try:
            await repo.jobs.create(new, now=datetime.now(UTC))
        finally:
            await repo.close()

    asyncio.run(store())
    return new.id


def test_a_stored_job_whose_input_fails_at_the_sampler_fails_as_its_own_fault(stack: LocalStack) -> None:
    client = stub(stack)
    thin = stored_by_an_older_gateway(stack, EDIT, png(4096, 1))  # a condition size of 65536x0 before its bounds
    wide = stored_by_an_older_gateway(stack, "tiny", png(2048, 64))
    failed = [wait_terminal(client, job_id) for job_id in (thin, wide)]
    for job in failed:
        assert job.status == pb.JOB_STATUS_FAILED, job
        assert job.error.startswith("image: is "), job.error
        assert job.attempts == 1 and not job.failed_attempts, "never retried"
    edit = pb.SubmitJobRequest(model=EDIT, prompt="make it night", image=png(96, 64), steps=2, seed=1)
    served = wait_terminal(client, client.SubmitJob(edit).job_id)
    assert served.status == pb.JOB_STATUS_SUCCEEDED, served.error
    assert png_size(served.images[0].data) == (96, 64)
    assert {job.worker_id for job in failed} == {served.worker_id}, "the same sampler serves the next edit"
    workers = client.GetStats(pb.GetStatsRequest()).workers
    assert [w.restarts for w in workers if w.worker_id == served.worker_id] == [0], "it never reported unhealthy"
