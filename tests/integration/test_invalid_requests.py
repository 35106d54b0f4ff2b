"""Bad input is rejected with INVALID_ARGUMENT naming the field, and nothing is stored."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import count_jobs, stub

pytestmark = [pytest.mark.integration, pytest.mark.quick]

GOOD: dict[str, Any] = {"model": "tiny", "prompt": "ok", "width": 64, "height": 64, "steps": 2}

CASES = [
    ("model", {"model": "no-such-model"}),
    ("model", {"model": ""}),
    ("prompt", {"prompt": ""}),
    ("prompt", {"prompt": "   "}),
    ("prompt", {"prompt": "x" * 2001}),
    ("negative_prompt", {"negative_prompt": "x" * 2001}),
    ("width", {"width": 100}),
    ("width", {"width": 8}),
    ("width", {"width": 4096}),
    ("height", {"height": 30}),
    ("height", {"height": 1024}),
    ("steps", {"steps": 101}),
    ("num_images", {"num_images": 5}),
    ("guidance_scale", {"guidance_scale": -1.0}),
    ("guidance_scale", {"guidance_scale": 51.0}),
    ("guidance_scale", {"guidance_scale": float("nan")}),
    ("seed", {"seed": 2**63}),
    ("idempotency_key", {"idempotency_key": "k" * 257}),
    ("lane", {"lane": "vip"}),
    # PostgreSQL's text holds no NUL: each was an INTERNAL error from the insert.
    ("prompt", {"prompt": "a\x00b"}),
    ("negative_prompt", {"negative_prompt": "\x00"}),
    ("idempotency_key", {"idempotency_key": "k\x00"}),
]


def violations(err: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(err)
    assert status is not None, "no rich status details"
    fields = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields


@pytest.mark.parametrize(("field", "change"), CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_invalid_field_is_named_and_nothing_stored(stack, field: str, change: dict) -> None:
    client = stub(stack)
    before = count_jobs(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.SubmitJob(pb.SubmitJobRequest(**{**GOOD, **change}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err.value) == [field]
    assert field in err.value.details()
    assert count_jobs(stack) == before


def test_every_violation_is_reported_at_once(stack) -> None:
    client = stub(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="", width=7, height=9000, steps=1000))
    assert sorted(violations(err.value)) == ["height", "prompt", "steps", "width"]


def test_valid_request_is_stored(stack) -> None:
    client = stub(stack)
    before = count_jobs(stack)
    client.SubmitJob(pb.SubmitJobRequest(**GOOD))
    assert count_jobs(stack) == before + 1
