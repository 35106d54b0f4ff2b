"""The gateway's failure paths, served in-process on port 0 (``create_server``):
a database that is away is UNAVAILABLE with a RetryInfo, never INTERNAL, and a
bad request names its field and stores nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from gateway.service import create_server
from services.config.sections import GatewaySettings, KernelSettings
from services.db.repository import Repository
from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.ops.processes import free_port
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from tests.conftest import migrated_database

pytestmark = [pytest.mark.integration, pytest.mark.quick]
Stub = image_generation_pb2_grpc.ImageGenerationStub


async def serving(database_url: str) -> AsyncIterator[image_generation_pb2_grpc.ImageGenerationStub]:
    repo = Repository(database_url, pool_size=1)
    server, servicer = create_server(
        KernelSettings(database_url=database_url), GatewaySettings(port=0), repo, ModelRegistry.load()
    )
    await server.grpc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield image_generation_pb2_grpc.ImageGenerationStub(ch)
    finally:
        await server.grpc.stop(0)
        await servicer.close()
        await repo.close()


@pytest.fixture
async def database_away() -> AsyncIterator[image_generation_pb2_grpc.ImageGenerationStub]:
    # Nothing listens there: every query fails to connect.
    async for stub in serving(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/darkroom"):
        yield stub


@pytest.fixture
async def gateway(
    postgres: EmbeddedPostgres,
) -> AsyncIterator[tuple[image_generation_pb2_grpc.ImageGenerationStub, str]]:
    url = migrated_database(postgres)
    async for stub in serving(url):
        yield stub, url.replace("postgresql+psycopg://", "postgresql://")


def retry_delay_s(err: grpc.aio.AioRpcError) -> float:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.RetryInfo()
    assert any(d.Unpack(info) for d in status.details), "no RetryInfo"
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="x", width=64, height=64, steps=1)),
        lambda s: s.GetJob(pb.GetJobRequest(job_id="x")),
        lambda s: s.CancelJob(pb.CancelJobRequest(job_id="x")),
        lambda s: s.ListModels(pb.ListModelsRequest()),
        lambda s: s.GetStats(pb.GetStatsRequest()),
    ],
    ids=["SubmitJob", "GetJob", "CancelJob", "ListModels", "GetStats"],
)
async def test_database_away_is_unavailable_with_retry_info(database_away, call) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(database_away)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert retry_delay_s(err.value) > 0


async def test_stream_with_database_away_is_unavailable(database_away) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in database_away.StreamJob(pb.StreamJobRequest(job_id="x")):
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_past_deadline_is_refused_naming_the_field_and_nothing_is_stored(gateway) -> None:
    stub, url = gateway
    request = pb.SubmitJobRequest(model="tiny", prompt="x", width=64, height=64, steps=1)
    request.deadline.FromDatetime(datetime.now(UTC) - timedelta(seconds=5))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SubmitJob(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    bad = error_details_pb2.BadRequest()
    assert status is not None and status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["deadline"]
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


async def test_deadline_is_kept_and_shown(gateway) -> None:
    stub, _ = gateway
    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5)
    request = pb.SubmitJobRequest(model="tiny", prompt="x", width=64, height=64, steps=1)
    request.deadline.FromDatetime(deadline)
    job = await stub.GetJob(pb.GetJobRequest(job_id=(await stub.SubmitJob(request)).job_id))
    assert job.deadline.ToDatetime(tzinfo=UTC) == deadline
