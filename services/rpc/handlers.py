"""Wrapping a gRPC method handler's behaviour, whatever its kind: for the server
interceptors that count calls and check callers' roles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

# A handler's behaviour, by its kind, and how to make a handler of that kind.
_HANDLER_KINDS: dict[str, Any] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def rewrapped(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap(behaviour)``."""
    for kind, make in _HANDLER_KINDS.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return make(  # type: ignore[no-any-return]
                wrap(behavior),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
