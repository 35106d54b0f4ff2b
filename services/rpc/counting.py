"""Counts and times every call a gRPC server handles, by method and final status
code (``darkroom_rpc_requests_total``, ``darkroom_rpc_duration_seconds``).

One interceptor wraps each method's handler. The status is the one the client
gets: what ``context.abort`` (or ``set_code``) put on the context, OK when the
handler returned, UNKNOWN for an exception grpc reports as such, CANCELLED when
the client went away (the handler's task is cancelled)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from services.rpc.handlers import rewrapped
from services.telemetry.metrics import RPC_DURATION, RPC_REQUESTS

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


@functools.lru_cache(maxsize=1024)
def method_label(method: str) -> str:
    """The method, if its service's descriptor has it, else "other": an interceptor
    that refuses a call (a missing API key) answers for any name a client makes up,
    and such names must not become label values."""
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        known = name in descriptor_pool.Default().FindServiceByName(service).methods_by_name
    except KeyError:
        known = False
    return method if known else "other"


def code_name(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    code: Any = context.code()
    if code is not None:
        return code.name if isinstance(code, grpc.StatusCode) else _CODE_NAMES.get(int(code), "UNKNOWN")
    if exc is None:
        return "OK"
    return "CANCELLED" if isinstance(exc, asyncio.CancelledError | GeneratorExit) else "UNKNOWN"


def _record(method: str, context: grpc.aio.ServicerContext, exc: BaseException | None, started: float) -> None:
    RPC_REQUESTS.labels(method=method, code=code_name(context, exc)).inc()
    RPC_DURATION.labels(method=method).observe(time.perf_counter() - started)


def _counted(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    """The behaviour (of any of the four kinds), counted and timed. aio handlers
    only: a streaming one is an async generator, or a coroutine that writes."""
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as exc:
                _record(method, context, exc, started)
                raise
            _record(method, context, None, started)

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
        except BaseException as exc:
            _record(method, context, exc, started)
            raise
        _record(method, context, None, started)
        return result

    return unary


class CountingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:  # grpc answers UNIMPLEMENTED
            return handler
        method = method_label(details.method or "")
        return rewrapped(handler, lambda behavior: _counted(method, behavior))
