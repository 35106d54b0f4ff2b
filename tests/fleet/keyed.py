"""A client of the fleet's gateways: every call presents the fleet's admin key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

# The fleet's gateways listen on addresses other hosts reach, so they are closed as
# an operator's would be: an admin key of DARKROOM_API_KEYS, which every client
# call here presents.
FLEET_API_KEY = "fleet-admin-key"


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Every call with ``authorization: Bearer FLEET_API_KEY``."""

    def _keyed(self, details: Any) -> _CallDetails:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {FLEET_API_KEY}")]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._keyed(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._keyed(details), request)


def with_key(channel: grpc.Channel) -> grpc.Channel:
    """``channel``, each call presenting the fleet's key."""
    return grpc.intercept_channel(channel, _Bearer())
