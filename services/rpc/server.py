"""gRPC server plumbing shared by every service: health checking and reflection on,
every call counted for Prometheus, mutual TLS and the role check where the mesh is
sealed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.mesh.rpc import ChannelCredentialsCache, MeshIdentity, RoleGuard
from services.rpc.counting import CountingInterceptor

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
# A client that keeps its connection alive with pings (every few seconds, to notice
# a gateway gone silent: docs/fleet.md) is not told "too many pings" and cut off,
# failing its calls under way: pings a second apart are fine while a stream of its
# waits for an event (gRPC's default allows one in five minutes without data), and
# between its calls (by default, each ping that arrives with no call open, as one
# crossing the end of a poll on a slow link does, is a strike, and the third cuts).
# (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is spelt as below.)
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
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
    *,
    mesh: MeshIdentity | None = None,
    roles: Mapping[str, frozenset[str]] | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> Server:
    """``registrations``: (adds the servicer to a server, full service name).
    Every call is counted, outermost: a call that another interceptor refuses
    is counted too. With ``mesh``, the port takes only callers with a certificate
    of the fleet's CA, and ``roles`` (service or method name: the roles that may
    call it) says who may call what; without, it is plaintext (an open mesh), or
    TLS with ``credentials`` (the public gateway's)."""
    guards: list[grpc.aio.ServerInterceptor] = []
    if mesh is not None:
        guards.append(RoleGuard(roles or {}, service=mesh.role))
        credentials = mesh.server_credentials()
    server = grpc.aio.server(interceptors=[CountingInterceptor(), *guards, *interceptors], options=SERVER_OPTIONS)
    for register, _ in registrations:
        register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [name for _, name in registrations]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    result = Server(server, bound, health_servicer)
    result._names = names
    return result


def channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


class Channels:
    """One channel per address, opened at first use and kept: for a process that
    calls many peers (samplers, decoders) again and again. With ``mesh``, each
    presents this process's certificate, and they are all reopened once it is
    renewed."""

    def __init__(self, mesh: MeshIdentity | None = None) -> None:
        self._open: dict[str, grpc.aio.Channel] = {}
        self._credentials = ChannelCredentialsCache(mesh) if mesh is not None else None
        self._retired: list[grpc.aio.Channel] = []

    def to(self, address: str) -> grpc.aio.Channel:
        if self._credentials is not None and self._credentials.renewed():
            # Calls under way finish on the old channels; they are closed with the rest.
            self._retired.extend(self._open.values())
            self._open = {}
        ch = self._open.get(address)
        if ch is None:
            creds = self._credentials.credentials if self._credentials is not None else None
            ch = self._open[address] = channel(address, creds)
        return ch

    async def close(self) -> None:
        open_, self._open, retired, self._retired = self._open, {}, self._retired, []
        for ch in [*open_.values(), *retired]:
            await ch.close()
