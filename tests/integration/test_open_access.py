"""Open by default only on the loopback: a gateway with no tenants and no
DARKROOM_API_KEYS refuses to start on an address other hosts reach, naming the fixes,
and `darkroom up` says the same before it starts anything; a tenant, a key, the
operator's DARKROOM_ALLOW_ANONYMOUS or a loopback address lets it start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.service import serve
from services.config.fields import SettingsError
from services.config.sections import GatewaySettings, KernelSettings
from services.db.repository import Repository
from services.db.tenant_records import TenantTerms
from services.ops.embedded import EmbeddedPostgres
from services.ops.processes import free_port
from tests.conftest import migrated_database

pytestmark = [pytest.mark.integration, pytest.mark.quick]

FIXES = ("DARKROOM_ALLOW_ANONYMOUS", "darkroom tenants create", "DARKROOM_API_KEYS")


@pytest.fixture
def database_url(postgres: EmbeddedPostgres) -> str:
    url = migrated_database(postgres)
    return url


async def start_gateway(database_url: str, settings: GatewaySettings, *, env: dict[str, str] | None = None) -> None:
    """The gateway's serve(), as its process runs it: serving health checks as
    SERVING within 30 s, then stopped. Raises what serve() raises."""
    stop = asyncio.Event()
    kernel = KernelSettings(database_url=database_url)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        serving = asyncio.create_task(serve(kernel, settings, stop))
        address = f"{'127.0.0.1' if settings.host == '0.0.0.0' else settings.host}:{settings.port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                for _ in range(300):
                    if serving.done():
                        serving.result()  # its error
                        raise AssertionError("the gateway stopped by itself")
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        reply = await health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(), timeout=0.5
                        )
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the gateway did not serve within 30 s")
        finally:
            stop.set()
            await asyncio.wait_for(serving, 30)


async def test_an_open_gateway_off_the_loopback_refuses_to_start_naming_the_fix(database_url: str) -> None:
    with pytest.raises(SettingsError) as refused:
        await start_gateway(database_url, GatewaySettings(host="0.0.0.0", port=free_port()))
    for fix in FIXES:
        assert fix in str(refused.value)
    # The HTTP API's listener counts too: it is the gateway's client.
    with pytest.raises(SettingsError, match=r"DARKROOM_HTTP_HOST 0\.0\.0\.0"):
        await start_gateway(database_url, GatewaySettings(port=free_port()), env={"DARKROOM_HTTP_HOST": "0.0.0.0"})


async def test_it_starts_on_the_loopback_or_with_a_key_the_operators_word_or_a_tenant(database_url: str) -> None:
    await start_gateway(database_url, GatewaySettings(host="127.0.0.1", port=free_port()))
    await start_gateway(database_url, GatewaySettings(host="0.0.0.0", port=free_port(), api_keys=("s3cret",)))
    await start_gateway(database_url, GatewaySettings(host="0.0.0.0", port=free_port(), allow_anonymous=True))
    repo = Repository(database_url)
    try:
        await repo.tenants.create("acme", TenantTerms("paid"), actor="test", now=datetime.now(UTC))
    finally:
        await repo.close()
    await start_gateway(database_url, GatewaySettings(host="0.0.0.0", port=free_port()))


def test_darkroom_up_refuses_before_starting_anything(tmp_path: Path, database_url: str) -> None:
    data = tmp_path / "data"
    env = {**os.environ, "DARKROOM_DATABASE_URL": database_url, "DARKROOM_GATEWAY_HOST": "0.0.0.0"}
    env.pop("DARKROOM_NATS_URL", None)
    env.pop("DARKROOM_API_KEYS", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "services.ops.cli", "up", "--data-dir", str(data), "--port", "0", "--http-port", "0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = up.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        up.terminate()  # a stack that started after all: stopped as Ctrl-C stops it, children with it
        up.communicate(timeout=120)
        raise AssertionError("darkroom up started an open stack off the loopback") from None
    assert up.returncode == 2, stderr
    for fix in FIXES:
        assert fix in stderr
    assert not list((data / "logs").glob("*.log"))  # no child was started
