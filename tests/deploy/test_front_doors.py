"""The front doors as the manifests run them: closed from the first start, keys
never in plaintext inside the cluster, the HTTP tier holding no more than it reads.

The gateway starts with an admin key from a Secret (so it is not open, and would
refuse to start without one: it listens on 0.0.0.0) and serves TLS with a
certificate its pod holds; the kubelet probes it without gRPC's plaintext. The HTTP
pods reach it over TLS, trusting a CA their pod holds, by the name the certificate
infra/k8s/README.md issues carries (a real handshake); they read the database as
darkroom_files, the role CloudNativePG makes and the migrations grant SELECT on
jobs and their images alone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config.http import HttpSettings
from services.config.sections import GatewaySettings
from services.mesh.pki import CertificateAuthority
from services.mesh.rpc import public_server_credentials
from services.open_access import refusal
from services.rpc.server import build_server
from tests.deploy.environment import container_env, load_settings
from tests.deploy.rendering import K8S, NAMESPACE, OVERLAYS, Pod, named, one, pods
from tests.deploy.sandbox import PodSandbox, secret_contents

FILES_ROLE = "darkroom_files"


def component(docs: list[dict[str, Any]], name: str) -> tuple[Pod, dict[str, Any]]:
    (pod,) = [p for p in pods(docs) if p.labels["app.kubernetes.io/component"] == name]
    (container,) = pod.spec["containers"]
    return pod, container


def env_source(container: dict[str, Any], name: str) -> dict[str, Any]:
    (var,) = [v for v in container["env"] if v["name"] == name]
    return var


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_starts_closed_with_an_admin_key_from_a_secret(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    pod, gateway = component(docs, "gateway")
    ref = env_source(gateway, "DARKROOM_API_KEYS")["valueFrom"]["secretKeyRef"]
    secret = named(docs, "Secret", "darkroom-admin-key")
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
    env, own_names = container_env(gateway, pod, docs)
    _, settings = load_settings("gateway", env, own_names)
    assert isinstance(settings, GatewaySettings) and settings.api_keys
    http = HttpSettings.from_env(env)
    assert refusal(settings, http, tenants_exist=False) is None
    # Without it, this gateway (on 0.0.0.0, no tenants yet) would refuse to start.
    without = GatewaySettings.from_env({k: v for k, v in env.items() if k != "DARKROOM_API_KEYS"})
    assert refusal(without, http, tenants_exist=False) is not None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_serves_tls_with_a_certificate_its_pod_holds(
    rendered: dict[str, list[dict[str, Any]]], mesh: Path, tmp_path: Path, overlay: str
) -> None:
    docs = rendered[overlay]
    pod, gateway = component(docs, "gateway")
    sandbox = PodSandbox(pod, secret_contents(docs, mesh), tmp_path)
    env, own_names = container_env(gateway, pod, docs)
    _, settings = load_settings("gateway", sandbox.env(env), own_names)
    assert isinstance(settings, GatewaySettings) and settings.tls_cert and settings.tls_key
    public_server_credentials(Path(settings.tls_cert), Path(settings.tls_key))  # what it loads at start
    # The kubelet's gRPC probe speaks plaintext only: it would fail on a TLS port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in gateway.get(probe, {}), f"the gateway's {probe} speaks plaintext gRPC"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_http_tier_reaches_the_gateway_over_tls_by_the_name_its_certificate_carries(
    rendered: dict[str, list[dict[str, Any]]], mesh: Path, tmp_path: Path, overlay: str
) -> None:
    docs = rendered[overlay]
    pod, http_container = component(docs, "http")
    sandbox = PodSandbox(pod, secret_contents(docs, mesh), tmp_path)
    env, own_names = container_env(http_container, pod, docs)
    _, settings = load_settings("http", sandbox.env(env), own_names)
    assert isinstance(settings, HttpSettings)
    assert settings.gateway_tls_ca and settings.gateway_tls_ca != "system"
    assert Path(settings.gateway_tls_ca).read_bytes() == (mesh / "ca.pem").read_bytes()  # the fleet's CA
    host, port = settings.gateway.rsplit(":", 1)
    service = one(docs, "Service", "darkroom-gateway")
    assert host == service["metadata"]["name"] and int(port) == service["spec"]["ports"][0]["port"]
    assert host in readme_gateway_names()


def readme_gateway_names() -> list[str]:
    """The names infra/k8s/README.md issues the gateway's certificate for."""
    readme = (K8S / "README.md").read_text()
    (line,) = [m[1] for m in re.finditer(r"^darkroom certs issue gateway (.*)$", readme, re.MULTILINE)]
    words = shlex.split(line.replace("$NS", NAMESPACE))
    return words[: words.index("--out")]


async def test_a_certificate_issued_as_the_readme_says_passes_the_http_tiers_check(tmp_path: Path) -> None:
    """A real handshake, as the HTTP tier makes it (http_api/gateway_client.py's
    channel: TLS trusting the CA file, the address's name checked): served, and
    refused in plaintext or under a name the certificate does not carry."""
    ca = CertificateAuthority.create()
    paths = ca.issue_into(tmp_path, "gateway", readme_gateway_names())
    server = build_server([], "127.0.0.1", 0, credentials=public_server_credentials(paths.cert, paths.key))
    await server.grpc.start()
    await server.set_serving(True)
    roots = grpc.ssl_channel_credentials(paths.ca.read_bytes())

    async def check(channel: grpc.aio.Channel) -> int:
        async with channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return int(reply.status)

    def as_named(name: str) -> grpc.aio.Channel:
        options = [("grpc.ssl_target_name_override", name)]
        return grpc.aio.secure_channel(f"127.0.0.1:{server.port}", roots, options=options)

    try:
        assert await check(as_named("darkroom-gateway")) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            await check(as_named("darkroom-elsewhere"))
        with pytest.raises(grpc.aio.AioRpcError):
            await check(grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))
    finally:
        await server.grpc.stop(0)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_http_tier_reads_the_database_as_the_read_only_role(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    pod, http_container = component(docs, "http")
    env, own_names = container_env(http_container, pod, docs)
    kernel, _ = load_settings("http", env, own_names)
    url = urlsplit(kernel.database_url)
    assert url.username == FILES_ROLE and url.password is None  # the password comes from the Secret
    ref = env_source(http_container, "PGPASSWORD")["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("darkroom-db-files", "password")
    secret = one(docs, "Secret", "darkroom-db-files")
    assert secret["type"] == "kubernetes.io/basic-auth" and set(secret["data"]) == {"username", "password"}
    assert secret["metadata"]["labels"]["cnpg.io/reload"] == "true"
    # CloudNativePG makes the role before any migration, and gives it its login and that password.
    cluster = one(docs, "Cluster", "darkroom-db")["spec"]
    assert f"CREATE ROLE {FILES_ROLE} NOLOGIN" in cluster["bootstrap"]["initdb"]["postInitApplicationSQL"]
    (role,) = [r for r in cluster["managed"]["roles"] if r["name"] == FILES_ROLE]
    assert role["login"] and role["passwordSecret"]["name"] == "darkroom-db-files"
    assert not any(role.get(power) for power in ("superuser", "createdb", "createrole", "replication", "bypassrls"))
    # Nothing else reads the database as that role, or holds its password.
    for other in pods(docs):
        if other.name == pod.name:
            continue
        for container in [*other.spec.get("initContainers", []), *other.spec["containers"]]:
            sources = [v.get("valueFrom", {}).get("secretKeyRef", {}).get("name") for v in container.get("env", [])]
            assert "darkroom-db-files" not in sources, f"{other.name} holds the HTTP tier's password"
