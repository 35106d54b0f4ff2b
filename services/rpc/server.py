"""gRPC server plumbing shared by every service: health checking and reflection on,
every call counted for Prometheus."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.rpc.counting import CountingInterceptor

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


class Server:
    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer) -> None:
        self.grpc = server
        self.port = port
        self.health = health_servicer

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        for name in self._names:
            await self.health.set(name, status)

    _names: Sequence[str] = ()


def build_server(
    registrations: Sequence[tuple[Callable[[grpc.aio.Server], None], str]],
    host: str,
    port: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> Server:
    """``registrations``: (adds the servicer to a server, full service name).
    Every call is counted, outermost: a call that another interceptor refuses
    is counted too."""
    server = grpc.aio.server(interceptors=[CountingInterceptor(), *interceptors], options=CHANNEL_OPTIONS)
    for register, _ in registrations:
        register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [name for _, name in registrations]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    result = Server(server, bound, health_servicer)
    result._names = names
    return result


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class Channels:
    """One channel per address, opened at first use and kept: for a process that
    calls many peers (samplers, decoders) again and again."""

    def __init__(self) -> None:
        self._open: dict[str, grpc.aio.Channel] = {}

    def to(self, address: str) -> grpc.aio.Channel:
        ch = self._open.get(address)
        if ch is None:
            ch = self._open[address] = channel(address)
        return ch

    async def close(self) -> None:
        open_, self._open = self._open, {}
        for ch in open_.values():
            await ch.close()
