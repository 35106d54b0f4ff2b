"""Errors as gRPC statuses: the kind of error decides the code, with rich details."""

from __future__ import annotations

from google.rpc import code_pb2, error_details_pb2

from services.errors import (
    ContentPolicyViolation,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StoreUnavailable,
)
from services.rpc.status import to_status


def test_invalid_argument_carries_field_violations() -> None:
    status = to_status(InvalidArgument([FieldViolation("width", "too big")]))
    assert status.code == code_pb2.INVALID_ARGUMENT
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "width"


def test_resource_exhausted_carries_retry_delay() -> None:
    status = to_status(ResourceExhausted("busy", retry_after_s=2.5))
    info = error_details_pb2.RetryInfo()
    assert status.code == code_pb2.RESOURCE_EXHAUSTED and status.details[0].Unpack(info)
    assert info.retry_delay.seconds == 2 and info.retry_delay.nanos == 500_000_000


def test_other_errors_map_to_their_codes() -> None:
    assert to_status(NotFound("x")).code == code_pb2.NOT_FOUND
    assert to_status(StoreUnavailable("x")).code == code_pb2.UNAVAILABLE
    assert to_status(RuntimeError("secret")).message == "internal error"


def test_a_content_policy_violation_names_the_field_and_its_reason_and_nothing_else() -> None:
    status = to_status(ContentPolicyViolation("prompt"))
    bad, info = error_details_pb2.BadRequest(), error_details_pb2.ErrorInfo()
    assert status.code == code_pb2.INVALID_ARGUMENT
    assert status.details[0].Unpack(bad) and status.details[1].Unpack(info)
    assert [(v.field, v.description) for v in bad.field_violations] == [("prompt", "violates the content policy")]
    assert info.reason == "CONTENT_POLICY_VIOLATION" and not info.metadata
    assert status.message == "prompt: violates the content policy"
