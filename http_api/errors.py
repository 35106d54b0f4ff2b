"""The gateway's refusals (gRPC status codes with rich details) as OpenAI's error
JSON and HTTP status, so that OpenAI's SDKs raise their own typed exceptions: 400
naming the parameter, 401, 403, 404, 429 and 503 with Retry-After. Darkroom's
field names become the request's parameter names."""

from __future__ import annotations

import math
from typing import Any

import grpc
from aiohttp import web
from google.rpc import error_details_pb2, status_pb2

# (HTTP status, OpenAI error type, code) per gRPC status.
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
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
}
_DETAILS_KEY = "grpc-status-details-bin"


class HttpError(Exception):
    """A request the HTTP API answers with an error, as OpenAI's would."""

    def __init__(
        self, status: int, message: str, *, kind: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.retry_after_s: float | None = None

    def response(self) -> web.Response:
        body: dict[str, Any] = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return web.json_response({"error": body}, status=self.status, headers=headers)


def bad_request(param: str, message: str) -> HttpError:
    return HttpError(400, message, kind="invalid_request_error", code="invalid_value", param=param)


def from_rpc(exc: grpc.aio.AioRpcError) -> HttpError:
    status, kind, code = _BY_CODE.get(exc.code(), (500, "server_error", None))
    details = _details(exc)
    error = HttpError(status, exc.details() or exc.code().name, kind=kind, code=code)
    for detail in details.details if details is not None else ():
        bad, retry, quota = (
            error_details_pb2.BadRequest(),
            error_details_pb2.RetryInfo(),
            error_details_pb2.QuotaFailure(),
        )
        if detail.Unpack(bad) and bad.field_violations:
            first = bad.field_violations[0]
            error.param = PARAMETERS.get(first.field, first.field)
        elif detail.Unpack(retry):
            error.retry_after_s = retry.retry_delay.ToTimedelta().total_seconds()
        elif detail.Unpack(quota) and any("credits" in v.description for v in quota.violations):
            error.code = "insufficient_quota"
    return error


def _details(exc: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    for key, value in exc.trailing_metadata() or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            return status_pb2.Status.FromString(value)
    return None
