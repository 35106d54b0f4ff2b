"""Samplers and decoders register stable names the mesh accepts.

The address a worker registers is the DNS name its headless Service gives its pod,
with the port it listens on; the wildcard certificate infra/k8s/README.md issues for
that Service passes the check the scheduler makes when it dials a sampler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.mesh.pki import CertificateAuthority
from services.mesh.rpc import MeshIdentity
from services.rpc.server import build_server
from tests.deploy.environment import container_env
from tests.deploy.rendering import OVERLAYS, one, pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_samplers_and_decoders_register_their_own_stable_names(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The address a worker registers is the DNS name the headless Service gives
    its pod, published before the pod is ready, with the port it listens on."""
    docs = rendered[overlay]
    for kind in ("sampler", "decoder"):
        workload = one(docs, "StatefulSet", f"darkroom-{kind}")
        (pod,) = [p for p in pods(docs) if p.name == f"darkroom-{kind}-0"]
        env, _ = container_env(pod.spec["containers"][0], pod, docs)
        service = one(docs, "Service", workload["spec"]["serviceName"])
        domain = env["CLUSTER_DOMAIN"]
        host = env[f"DARKROOM_{kind.upper()}_HOST"]
        assert host == f"{pod.name}.{service['metadata']['name']}.{pod.namespace}.svc.{domain}"
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"].items() <= pod.labels.items()
        assert [p["port"] for p in service["spec"]["ports"]] == [int(env[f"DARKROOM_{kind.upper()}_PORT"])]


async def test_a_wildcard_certificate_of_the_headless_service_passes_the_mesh_check(tmp_path: Path) -> None:
    """What infra/k8s/README.md issues for samplers, checked by gRPC as the scheduler
    checks a sampler it dials; a name outside the wildcard is refused."""
    ca = CertificateAuthority.create()
    for role, hosts in (("sampler", ["*.darkroom-sampler.darkroom.svc.cluster.local"]), ("scheduler", ["x"])):
        ca.issue_into(tmp_path, role, hosts)
    server = build_server([], "127.0.0.1", 0, mesh=MeshIdentity(tmp_path, "sampler"))
    await server.grpc.start()
    await server.set_serving(True)
    scheduler = MeshIdentity(tmp_path, "scheduler").channel_credentials()

    async def check(name: str) -> int:
        options = [("grpc.ssl_target_name_override", name)]
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", scheduler, options=options) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return int(reply.status)

    try:
        assert await check("darkroom-sampler-3.darkroom-sampler.darkroom.svc.cluster.local") == 1
        with pytest.raises(grpc.aio.AioRpcError):
            await check("darkroom-sampler-3.darkroom-sampler.elsewhere.svc.cluster.local")
    finally:
        await server.grpc.stop(0)
