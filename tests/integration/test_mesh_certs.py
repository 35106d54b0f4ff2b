"""The fleet's certificates: what `darkroom certs issue` writes, and a server that
serves a renewed certificate without a restart."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.service import create_server
from services.config.fields import SettingsError
from services.config.sections import GatewaySettings, KernelSettings, Settings
from services.db.repository import Repository
from services.mesh.pki import CertificateAuthority, CertPaths, certificate_role
from services.mesh.rpc import MeshIdentity
from services.mesh.secrets import ensure_certificates
from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.rpc.client import generate
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.rpc.server import build_server
from tests.conftest import make_stack, migrated_database

pytestmark = pytest.mark.integration


def darkroom(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
    return subprocess.run(
        [sys.executable, "-m", "services.ops.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_certs_issue_signs_a_role_for_a_host_with_the_fleet_ca(tmp_path: Path) -> None:
    done = darkroom(
        "certs",
        "issue",
        "sampler",
        "gpu-7.lan",
        "10.0.0.7",
        "--data-dir",
        str(tmp_path),
        "--out",
        str(tmp_path / "gpu7"),
    )
    assert done.returncode == 0, done.stderr
    paths = CertPaths.of(tmp_path / "gpu7", "sampler")
    for path in (paths.ca, paths.cert, paths.key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    cert = x509.load_pem_x509_certificate(paths.cert.read_bytes())
    ca = CertificateAuthority.load(tmp_path / "secrets")
    cert.verify_directly_issued_by(ca.cert)
    assert certificate_role(paths.cert.read_bytes()) == "sampler"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["gpu-7.lan"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    refused = darkroom("certs", "issue", "sampler", "--data-dir", str(tmp_path))
    assert refused.returncode == 2 and "HOST" in refused.stderr


async def test_a_server_serves_its_renewed_certificate_without_a_restart(tmp_path: Path) -> None:
    ca = CertificateAuthority.create()
    ca.save(tmp_path)
    ca.issue_into(tmp_path, "decoder", ["127.0.0.1"])
    ca.issue_into(tmp_path, "sampler", ["127.0.0.1"])
    server = build_server([], "127.0.0.1", 0, mesh=MeshIdentity(tmp_path, "decoder"))
    await server.grpc.start()
    caller = MeshIdentity(tmp_path, "sampler").channel_credentials()

    async def check(name: str) -> grpc.StatusCode:
        options = [("grpc.ssl_target_name_override", name)]
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", caller, options=options) as ch:
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[attr-defined, no-any-return]
        return grpc.StatusCode.OK

    try:
        assert await check("127.0.0.1") == grpc.StatusCode.OK
        assert await check("renewed.example") == grpc.StatusCode.UNAVAILABLE
        # Renewed with one more name: the next handshake presents it.
        ca.issue_into(tmp_path, "decoder", ["127.0.0.1", "renewed.example"])
        os.utime(CertPaths.of(tmp_path, "decoder").cert, (1, 1))  # a change the server sees, whatever the clock's grain
        assert await check("renewed.example") == grpc.StatusCode.OK
    finally:
        await server.grpc.stop(0)


async def test_the_gateway_serves_tls_when_given_a_certificate(tmp_path: Path, postgres: EmbeddedPostgres) -> None:
    ca = CertificateAuthority.create()
    paths = ca.issue_into(tmp_path, "gateway", ["127.0.0.1"])
    url = migrated_database(postgres)
    repo = Repository(url, pool_size=1)
    settings = GatewaySettings(port=0, tls_cert=str(paths.cert), tls_key=str(paths.key))
    server, servicer = create_server(KernelSettings(database_url=url), settings, repo, ModelRegistry.load())
    await server.grpc.start()
    request = pb.ListModelsRequest()
    try:
        trusting = grpc.ssl_channel_credentials(root_certificates=paths.ca.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", trusting) as ch:
            reply = await image_generation_pb2_grpc.ImageGenerationStub(ch).ListModels(request, timeout=10)
            assert [m.name for m in reply.models]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.RpcError) as refused:
                await image_generation_pb2_grpc.ImageGenerationStub(ch).ListModels(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.grpc.stop(0)
        await servicer.close()
        await repo.close()


def test_the_gateway_wants_both_its_certificate_and_its_key() -> None:
    with pytest.raises(SettingsError, match="DARKROOM_GATEWAY_TLS_KEY"):
        Settings.from_env({"DARKROOM_GATEWAY_TLS_CERT": "/etc/darkroom/gateway.pem"})


def test_a_stack_with_a_tls_gateway_generates_over_tls(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    secrets = tmp_path / "stack" / "secrets"
    ensure_certificates(secrets)  # the stack's own CA, as `darkroom up` would make it
    CertificateAuthority.load(secrets).issue_into(secrets, "gateway", ["127.0.0.1"])
    stack = make_stack(
        tmp_path / "stack",
        postgres,
        models_dir,
        gateway_tls_cert=str(secrets / "gateway.pem"),
        gateway_tls_key=str(secrets / "gateway.key"),
    )
    try:
        stack.start()  # ready: its health check went over TLS
        request = pb.SubmitJobRequest(model="tiny", prompt="over tls", width=64, height=64, steps=2)
        job, images = generate(stack.gateway_address, request, tls_roots=stack.gateway_roots(), on_progress=None)
        assert job.status == pb.JOB_STATUS_SUCCEEDED and len(images) == 1
        with grpc.insecure_channel(stack.gateway_address) as ch, pytest.raises(grpc.RpcError) as plaintext:
            image_generation_pb2_grpc.ImageGenerationStub(ch).SubmitJob(request, timeout=5)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        stack.stop()
