"""The gateway's refusals as OpenAI's errors: the status each SDK maps to its own
exception, the parameter named as the request named it, Retry-After when the
gateway says when to retry."""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from http_api.errors import from_rpc
from services.errors import ContentPolicyViolation
from services.rpc.status import to_status


def refusal(code: grpc.StatusCode, *details: object) -> grpc.aio.AioRpcError:
    status = status_pb2.Status(code=code.value[0], message="refused")
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)  # type: ignore[arg-type]
        status.details.append(packed)
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="refused")


def retry_in(seconds: int) -> error_details_pb2.RetryInfo:
    return error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds))


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.ALREADY_EXISTS, 409),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),  # not 409: the SDKs retry a 409, and only an operator fixes it
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_each_refusal_has_the_status_the_sdks_map(code: grpc.StatusCode, status: int) -> None:
    response = from_rpc(refusal(code)).response()
    assert response.status == status
    assert json.loads(response.body)["error"]["message"] == "refused"  # type: ignore[arg-type]


def test_a_bad_field_is_named_as_the_request_named_it() -> None:
    bad = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field="num_images", description="too many")]
    )
    assert from_rpc(refusal(grpc.StatusCode.INVALID_ARGUMENT, bad)).param == "n"


def test_a_refusal_that_says_when_to_retry_says_it_in_retry_after() -> None:
    busy = from_rpc(refusal(grpc.StatusCode.UNAVAILABLE, retry_in(3))).response()
    assert (busy.status, busy.headers["Retry-After"]) == (503, "3")
    quota = error_details_pb2.QuotaFailure(
        violations=[error_details_pb2.QuotaFailure.Violation(subject="tenant:cats", description="credits: 0 left")]
    )
    spent = from_rpc(refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, quota, retry_in(90)))
    assert spent.code == "insufficient_quota" and spent.response().headers["Retry-After"] == "90"
    assert "Retry-After" not in from_rpc(refusal(grpc.StatusCode.RESOURCE_EXHAUSTED)).response().headers


def test_an_error_after_the_submit_names_the_job_and_asks_not_to_be_retried() -> None:
    """OpenAI's SDKs retry every status of 500 and above unless x-should-retry says no."""
    gone = from_rpc(refusal(grpc.StatusCode.UNAVAILABLE)).after_submit("job-1").response()
    assert (gone.status, gone.headers["x-should-retry"]) == (503, "false")
    assert json.loads(gone.body)["error"]["job_id"] == "job-1"  # type: ignore[arg-type]
    before = from_rpc(refusal(grpc.StatusCode.UNAVAILABLE)).response()
    assert "x-should-retry" not in before.headers and "job_id" not in json.loads(before.body)["error"]  # type: ignore[arg-type]


def test_a_limit_with_no_time_to_retry_asks_not_to_be_retried() -> None:
    assert from_rpc(refusal(grpc.StatusCode.RESOURCE_EXHAUSTED)).response().headers["x-should-retry"] == "false"
    later = from_rpc(refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_in(3))).response()
    assert "x-should-retry" not in later.headers


def test_details_that_are_no_status_are_ignored() -> None:
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", b"\xff\xfe not a status"))
    odd = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), trailing, details="odd")
    assert from_rpc(odd).status == 400


def test_a_content_policy_violation_is_openai_s() -> None:
    status = to_status(ContentPolicyViolation("prompt"))
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    refused = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), trailing, status.message)
    response = from_rpc(refused).response()
    assert response.status == 400
    error = json.loads(response.body)["error"]  # type: ignore[arg-type]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "content_policy_violation",
        "prompt",
    )
