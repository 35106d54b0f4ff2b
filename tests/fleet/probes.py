"""What the fleet scenarios read off a running fleet, as an operator's tools
would: a gateway's health, the dispatch stream's replicas, round trips between
hosts, and each stage of small jobs."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import TYPE_CHECKING

import grpc
import nats
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.bus.credentials import NatsCredentials
from services.bus.dispatch import DISPATCH_STREAM
from tests.faults.harness import Load
from tests.fleet.postgres_ha import PORT

if TYPE_CHECKING:
    from tests.fleet.fleet import Fleet

STAGES = ("queue", "schedule", "dispatch", "sample", "decode", "store")


def gateway_up(address: str) -> bool:
    """Whether the gateway at ``address`` answers its health check as serving."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def stream_replicas_current(fleet: Fleet) -> bool:
    """Whether the dispatch stream has a leader and every other replica is
    current, as the operator's NATS user reads it."""
    credentials = NatsCredentials.of(fleet.operator_mesh, "operator", "operator")
    assert credentials is not None

    async def read() -> bool:
        nc = await nats.connect(
            fleet.nats_url.split(","),
            user=credentials.user,
            password=credentials.password,
            tls=credentials.tls,
            connect_timeout=2,
            max_reconnect_attempts=0,
        )
        try:
            info = await nc.jetstream().stream_info(DISPATCH_STREAM)
        finally:
            await nc.close()
        cluster = info.cluster
        if cluster is None or not cluster.leader:
            return False
        replicas = cluster.replicas or []
        return len(replicas) == len(fleet.nats) - 1 and all(r.current and not r.offline for r in replicas)

    try:
        return asyncio.run(read())
    except Exception:  # NATS not answering yet: not current
        return False


# Run on a host: the median time to open a TCP connection to each address, in ms.
_CONNECT_TIMES = """
import socket, statistics, sys, time
times = []
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    for _ in range(5):
        began = time.perf_counter()
        socket.create_connection((host, int(port)), timeout=5).close()
        times.append(time.perf_counter() - began)
print(statistics.median(times) * 1000)
"""


def round_trip_ms(fleet: Fleet) -> float:
    """One round trip between hosts: the median time to open a TCP connection from
    a control host to each NATS and database node."""
    targets = [url.removeprefix("nats://") for url in fleet.nats_url.split(",")]
    targets += [f"{n.host.address}:{PORT}" for n in fleet.postgres.nodes]
    return float(fleet.control[1].run([sys.executable, "-c", _CONNECT_TIMES, *targets]).strip())


def stage_latencies(load: Load, *, jobs: int) -> dict[str, float]:
    """Small jobs, one at a time, through ``load``: the median of each stage (the
    job's own stage durations) and of the whole as the client saw it (``client``)."""
    stages: dict[str, list[float]] = {}
    for _ in range(jobs):
        began = time.perf_counter()
        [job_id] = load.submit(1, steps=4)
        followed = load.jobs[-1]
        assert followed.thread is not None
        followed.thread.join(120)
        stages.setdefault("client", []).append(time.perf_counter() - began)
        durations = load.get(job_id).stage_durations
        for name in STAGES:
            stages.setdefault(name, []).append(getattr(durations, f"{name}_seconds"))
    return {name: statistics.median(values) for name, values in stages.items()}
