"""The one place where Darkroom's exceptions become gRPC status codes, with rich
details (``BadRequest`` field violations, ``RetryInfo``, ``ErrorInfo``)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.errors import (
    AlreadyExists,
    ContentPolicyViolation,
    DarkroomError,
    DegenerateOutput,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StoreUnavailable,
    Unauthenticated,
)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
# ErrorInfo's domain (the API's package), and the reasons that tell refusals of one code apart.
DOMAIN = "darkroom.v1"
CONTENT_POLICY_VIOLATION = "CONTENT_POLICY_VIOLATION"


def to_status(exc: BaseException) -> status_pb2.Status:
    status = status_pb2.Status(code=code_pb2.INTERNAL, message="internal error")
    if isinstance(exc, InvalidArgument):
        status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(exc))
        detail = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in exc.violations
            ]
        )
        status.details.add().Pack(detail)
        if isinstance(exc, ContentPolicyViolation):
            # The reason a client (and the HTTP door: OpenAI's content_policy_violation) tells apart.
            status.details.add().Pack(error_details_pb2.ErrorInfo(reason=CONTENT_POLICY_VIOLATION, domain=DOMAIN))
    elif isinstance(exc, NotFound):
        status = status_pb2.Status(code=code_pb2.NOT_FOUND, message=str(exc))
    elif isinstance(exc, AlreadyExists):
        status = status_pb2.Status(code=code_pb2.ALREADY_EXISTS, message=str(exc))
    elif isinstance(exc, Unauthenticated):
        status = status_pb2.Status(code=code_pb2.UNAUTHENTICATED, message=str(exc))
    elif isinstance(exc, PermissionDenied):
        status = status_pb2.Status(code=code_pb2.PERMISSION_DENIED, message=str(exc))
    elif isinstance(exc, FailedPrecondition):
        status = status_pb2.Status(code=code_pb2.FAILED_PRECONDITION, message=str(exc))
    elif isinstance(exc, ResourceExhausted):
        status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(exc))
        if exc.quota is not None:
            violation = error_details_pb2.QuotaFailure.Violation(
                subject=exc.quota.subject, description=exc.quota.description
            )
            status.details.add().Pack(error_details_pb2.QuotaFailure(violations=[violation]))
        if exc.retry_after_s is not None:
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=_duration(exc.retry_after_s)))
    elif isinstance(exc, StoreUnavailable):
        status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message="storage unavailable, retry shortly")
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=_duration(1.0)))
    elif isinstance(exc, DegenerateOutput):
        # The output is corrupt, not the request: another worker may produce a good one.
        status = status_pb2.Status(code=code_pb2.DATA_LOSS, message=str(exc))
    elif isinstance(exc, DarkroomError):
        status = status_pb2.Status(code=code_pb2.INTERNAL, message=str(exc))
    return status


def field_violations(exc: grpc.aio.AioRpcError) -> list[FieldViolation]:
    """The fields a server's INVALID_ARGUMENT names (its ``BadRequest``, as
    ``to_status`` packs it); none for another code, or a status without them."""
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return []
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except ValueError:  # details that contradict the call's code or message
        return []
    found = []
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            found += [FieldViolation(v.field, v.description) for v in bad.field_violations]
    return found


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = math.floor(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if not isinstance(exc, DarkroomError):
        log.exception("unexpected error in handler", exc_info=exc)
    await context.abort_with_status(rpc_status.to_status(to_status(exc)))


def unary_errors(fn: F) -> F:
    """Maps exceptions from a unary handler to statuses."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapper  # type: ignore[return-value]


def stream_errors(fn: F) -> F:
    """Maps exceptions from a server-streaming handler to statuses."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapper  # type: ignore[return-value]
