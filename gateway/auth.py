"""API keys: ``authorization: Bearer <key>`` metadata on every public call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from services.errors import Unauthenticated
from services.rpc.status import to_status

PUBLIC_PREFIX = "/darkroom.v1."
STREAMING_METHODS = frozenset({"/darkroom.v1.ImageGeneration/StreamJob"})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: Iterable[str]) -> None:
        self._accepted = frozenset(f"Bearer {k}" for k in keys)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if not method.startswith(PUBLIC_PREFIX):
            return await continuation(details)  # health checks and reflection stay open
        metadata = dict(details.invocation_metadata or ())
        if metadata.get("authorization") in self._accepted:
            return await continuation(details)
        message = "missing or unknown API key: send `authorization: Bearer <key>`"
        if method in STREAMING_METHODS:
            return grpc.unary_stream_rpc_method_handler(_deny_stream(message))
        return grpc.unary_unary_rpc_method_handler(_deny(message))


def _deny(message: str) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> None:
        await _abort(context, message)

    return handler


def _deny_stream(message: str) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _abort(context, message)
        yield  # pragma: no cover - makes this an async generator

    return handler


async def _abort(context: grpc.aio.ServicerContext, message: str) -> None:
    from grpc_status import rpc_status

    await context.abort_with_status(rpc_status.to_status(to_status(Unauthenticated(message))))
