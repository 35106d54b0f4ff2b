"""SubmitJob fuzzed over real gRPC: whatever the request, the answer is a decision
(the job stored, or a refusal naming what is wrong), never INTERNAL or UNKNOWN, and
the gateway serves on after."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import stub

pytestmark = pytest.mark.integration

# What a user's mistake or the service's state may answer; INTERNAL and UNKNOWN
# would be the gateway's own failure.
DECISIONS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
TEXT = st.sampled_from(["\x00", "a\x00b", "\u2028", "\U0001f600"]) | st.text(st.characters(codec="utf-8"), max_size=40)
UINT = st.sampled_from([0, 1, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True)
# A request that would be stored, and what each field may be instead.
VALID = {"model": "tiny", "prompt": "a lighthouse", "width": 64, "height": 64, "steps": 1}
JUNK: dict[str, st.SearchStrategy[object]] = {
    "model": st.sampled_from(["tiny-upscaler", "tiny-wan", ""]) | TEXT,
    "prompt": TEXT,
    "negative_prompt": TEXT,
    "width": UINT,
    "height": UINT,
    "steps": UINT,
    "guidance_scale": FLOAT,
    "seed": st.integers(0, 2**64 - 1),
    "num_images": UINT,
    "idempotency_key": TEXT,
    "lane": st.sampled_from(["free", "paid"]) | TEXT,
    "output_format": st.integers(-5, 50),
    "frames": UINT,
    "fps": FLOAT,
    "image": st.binary(max_size=64),
    "mask": st.binary(max_size=16),
    "strength": FLOAT,
    "previews": UINT,
}


@st.composite
def requests(draw: st.DrawFn) -> pb.SubmitJobRequest:
    """A valid request with up to three of its fields anything their types hold: a
    bad value alone reaches as deep as the gateway lets it."""
    broken = draw(st.lists(st.sampled_from(sorted(JUNK)), max_size=3, unique=True))
    fields: dict[str, object] = {**VALID, **{name: draw(JUNK[name]) for name in broken}}
    req = pb.SubmitJobRequest()
    for name, value in fields.items():
        setattr(req, name, value)
    return req


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(req=requests())
def test_a_fuzzed_submit_is_decided_never_an_internal_error(stack, req: pb.SubmitJobRequest) -> None:
    client = stub(stack)
    try:
        reply = client.SubmitJob(req, timeout=30)
    except grpc.RpcError as err:
        assert err.code() in DECISIONS, (err.code(), err.details(), req)
        assert err.details(), "a refusal names what is wrong"
    else:
        # Stored: cancelled at once, so that the fuzz does not queue work for the sampler.
        client.CancelJob(pb.CancelJobRequest(job_id=reply.job_id), timeout=30)


def test_the_gateway_serves_after_the_fuzz(stack) -> None:
    client = stub(stack)
    reply = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="after", width=64, height=64, steps=1))
    assert client.GetJob(pb.GetJobRequest(job_id=reply.job_id)).job_id == reply.job_id
