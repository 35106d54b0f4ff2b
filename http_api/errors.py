"""Every error the HTTP API answers, in one place, as OpenAI's error JSON and HTTP
status, so that OpenAI's SDKs raise their own typed exceptions: the gateway's
refusals (gRPC status codes with rich details: 400 naming the parameter, or
``content_policy_violation`` for a prompt the content policy refuses, 401, 403,
404, 409, 429 and 503 with Retry-After), a body too large (413), and anything
unexpected (500, never a plain-text page). Darkroom's field names become the
request's parameter names.

An error answered after the request's job was accepted carries the job's id and
``x-should-retry: false``: OpenAI's SDKs retry every status of 500 and above, and
a retry would submit the job again; the caller follows the job instead."""

from __future__ import annotations

import math
from typing import Any

import grpc
from aiohttp import web
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from services.rpc.status import CONTENT_POLICY_VIOLATION

# (HTTP status, OpenAI error type, code) per gRPC status.
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    # 400, not 409: what is missing stays missing until an operator acts (the
    # gateway has no model store, a base model must be pushed again), and OpenAI's
    # SDKs retry a 409, an upload's whole file each time; a 400 they do not.
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
# A SubmitJobRequest's fields by the name the HTTP request gave them.
PARAMETERS = {
    "num_images": "n",
    "width": "size",
    "height": "size",
    "guidance_scale": "guidance",
    "image": "image",
    "mask": "mask",
    "idempotency_key": "Idempotency-Key",
}
_DETAILS_KEY = "grpc-status-details-bin"
# How much of a bad value an error message quotes.
QUOTED_CHARS = 40


class HttpError(Exception):
    """A request the HTTP API answers with an error, as OpenAI's would."""

    def __init__(
        self, status: int, message: str, *, kind: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.retry_after_s: float | None = None
        # x-should-retry, which OpenAI's SDKs obey over the status; None: the status decides.
        self.should_retry: bool | None = None
        self.extra: dict[str, Any] = {}  # Darkroom's own, beside OpenAI's fields

    def after_submit(self, job_id: str) -> HttpError:
        """This error, answered once ``job_id`` was accepted: it names the job to
        follow, and asks not to be retried (a retry would be a second job)."""
        self.extra["job_id"] = job_id
        self.should_retry = False
        return self

    def body(self) -> dict[str, Any]:
        """OpenAI's error object (the ``error`` of a response, or of a stream's ``error`` event)."""
        return {"message": self.message, "type": self.kind, "param": self.param, "code": self.code, **self.extra}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return web.json_response({"error": self.body()}, status=self.status, headers=headers)


def bad_request(param: str, message: str) -> HttpError:
    return HttpError(400, message, kind="invalid_request_error", code="invalid_value", param=param)


def too_large(limit: int) -> HttpError:
    return HttpError(
        413, f"the body is over this route's limit of {limit} bytes", kind="invalid_request_error", param="body"
    )


def not_found(what: str) -> HttpError:
    return HttpError(404, f"no such {what}", kind="invalid_request_error", code="not_found")


def unauthenticated(message: str) -> HttpError:
    return HttpError(401, message, kind="invalid_request_error", code="invalid_api_key")


def withheld(job_id: str, what: str = "outputs") -> HttpError:
    """A job's outputs all withheld: the image filter flagged them, and its policy
    blocks what it flags. OpenAI's ``content_policy_violation``; not to be retried
    (the same request makes the same outputs)."""
    return HttpError(
        400,
        f"job {job_id}: {what} withheld, flagged by the image filter under the content policy",
        kind="invalid_request_error",
        code="content_policy_violation",
    ).after_submit(job_id)


def job_ended(job_id: str, status: str, error: str) -> HttpError:
    """A job that ended without its outputs (failed, cancelled, expired)."""
    return HttpError(
        500, f"job {job_id} ended {status}: {error}", kind="server_error", code=f"job_{status}"
    ).after_submit(job_id)


def still_running(job_id: str, url: str, waited_s: float) -> HttpError:
    """A job not finished within the wait: the caller follows it at ``url``."""
    return HttpError(
        504,
        f"job {job_id} is still running after {waited_s:.0f}s; follow it at {url} (GET: its status, then links "
        "to its outputs)",
        kind="server_error",
        code="job_running",
    ).after_submit(job_id)


def submit_unanswered(idempotency_key: str) -> HttpError:
    """A submit the gateway took but did not answer in time: the job may be stored."""
    error = HttpError(
        504,
        "the gateway did not answer the submit in time, and may have stored the job: send the request again "
        f"with the header Idempotency-Key: {idempotency_key} to get that job rather than a second one",
        kind="server_error",
        code="timeout",
    )
    error.extra["idempotency_key"] = idempotency_key
    error.should_retry = False
    return error


def unexpected() -> HttpError:
    return HttpError(500, "an unexpected error: it is logged", kind="server_error", code="internal_error")


def quoted(value: object) -> str:
    """A bad value as an error message shows it: at most QUOTED_CHARS of it."""
    text = repr(value)
    return text if len(text) <= QUOTED_CHARS else f"{text[:QUOTED_CHARS]}... ({len(text)} characters)"


def from_rpc(exc: grpc.aio.AioRpcError) -> HttpError:
    status, kind, code = _BY_CODE.get(exc.code(), (500, "server_error", None))
    details = _details(exc)
    error = HttpError(status, exc.details() or exc.code().name, kind=kind, code=code)
    for detail in details.details if details is not None else ():
        bad, retry, quota, info = (
            error_details_pb2.BadRequest(),
            error_details_pb2.RetryInfo(),
            error_details_pb2.QuotaFailure(),
            error_details_pb2.ErrorInfo(),
        )
        if detail.Unpack(bad) and bad.field_violations:
            first = bad.field_violations[0]
            error.param = PARAMETERS.get(first.field, first.field)
        elif detail.Unpack(info) and info.reason == CONTENT_POLICY_VIOLATION:
            error.code = "content_policy_violation"  # OpenAI's, for a refused prompt
        elif detail.Unpack(retry):
            error.retry_after_s = retry.retry_delay.ToTimedelta().total_seconds()
        elif detail.Unpack(quota) and any("credits" in v.description for v in quota.violations):
            error.code = "insufficient_quota"
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_s is None:
        error.should_retry = False  # the gateway names no time: nothing but an operator frees it
    return error


def _details(exc: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    for key, value in exc.trailing_metadata() or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:  # details that are no Status: the code alone
                return None
    return None
