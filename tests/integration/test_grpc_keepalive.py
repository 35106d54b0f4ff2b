"""A client that keeps its connection to a service alive with pings (the fleet's
clients every two seconds, to notice a silent gateway: docs/fleet.md) keeps it:
pings a second or more apart are never "too many", whether a call is under way or
not. A ping that crosses the end of a call (sent while the client still waits for
its answer, received after the server ended it) arrives with no call open; gRPC's
default takes each such ping as a strike and, at the third, cuts the connection with
"too many pings", failing a call under way: what a client polling across a slow
link met in the fleet suite. Pings with no call open are the sharpest case: they
pass only with the servers' minimum interval set under its real name and pings
without calls permitted (``services.rpc.server.SERVER_OPTIONS``)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.rpc.server import build_server

pytestmark = pytest.mark.integration


async def test_pings_between_calls_are_not_too_many() -> None:
    server = build_server([], "127.0.0.1", 0)
    await server.grpc.start()
    await server.set_serving(True)
    options = [
        ("grpc.keepalive_time_ms", 1500),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert channel.get_state() == grpc.ChannelConnectivity.READY
        # Idle past three pings, each arriving with no call open: the connection stays.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 6.0)
    finally:
        await channel.close()
        await server.grpc.stop(None)
