"""With API keys configured, the public API wants `authorization: Bearer <key>`;
health checks stay open."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.ops.children import child
from services.ops.processes import free_port
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from tests.helpers import env_of, wait_for

pytestmark = pytest.mark.integration


def test_api_key_required(stack) -> None:
    port = free_port()
    gateway = child(stack.settings, "gateway-auth", "gateway", env_of(gateway_port=port, api_keys=("s3cret",)))
    gateway.start()
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(ch)

        def check() -> int:
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                return -1

        wait_for(check, lambda s: s == health_pb2.HealthCheckResponse.SERVING, timeout=30, what="gateway")
        client = image_generation_pb2_grpc.ImageGenerationStub(ch)
        request = pb.SubmitJobRequest(model="tiny", prompt="x", width=64, height=64, steps=1)
        for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
            with pytest.raises(grpc.RpcError) as err:
                client.SubmitJob(request, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            list(client.StreamJob(pb.StreamJobRequest(job_id="x")))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = client.SubmitJob(request, metadata=[("authorization", "Bearer s3cret")])
        assert reply.job_id
    finally:
        gateway.stop()
