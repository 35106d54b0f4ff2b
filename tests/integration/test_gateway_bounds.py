"""A cap is checked before the work it bounds (issue 41): a gateway in this process,
on a fresh database, its tenants and keys made through the repository, asked for
more than any answer needs. Each is refused at once, naming the field, with a
message of bounded length, and nothing is read, decoded or remembered for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from gateway.service import create_server
from gateway.servicer import ImageGenerationServicer
from services import api_keys
from services.config.sections import GatewaySettings, KernelSettings
from services.db.records import ImageRecord
from services.db.repository import Repository
from services.db.tenant_records import TenantTerms
from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from tests.conftest import migrated_database
from tests.helpers import quota_failure

pytestmark = [pytest.mark.integration, pytest.mark.quick]
# The longest error message a refusal of an oversized field may carry.
BOUNDED = 400


@dataclass
class Gateway:
    client: image_generation_pb2_grpc.ImageGenerationStub
    servicer: ImageGenerationServicer
    repo: Repository
    keys: dict[str, list[tuple[str, str]]]  # each tenant's key, as call metadata


@pytest.fixture(scope="module")
async def gateway(postgres: EmbeddedPostgres) -> AsyncIterator[Gateway]:
    """Tenants ``cats`` (no limits) and ``larks`` (a rate of one submit in 1,000 s)."""
    url = migrated_database(postgres)
    repo = Repository(url, pool_size=2)
    now = datetime.now(UTC)
    keys = {}
    for name, terms in (("cats", TenantTerms("free")), ("larks", TenantTerms("free", rate_per_s=0.001))):
        await repo.tenants.create(name, terms, actor="test", now=now)
        issued = api_keys.new_key()
        await repo.tenants.add_key(name, issued, admin=False, actor="test", now=now)
        keys[name] = [("authorization", f"Bearer {issued.key}")]
    server, servicer = create_server(
        KernelSettings(database_url=url), GatewaySettings(port=0), repo, ModelRegistry.load()
    )
    await server.grpc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield Gateway(image_generation_pb2_grpc.ImageGenerationStub(ch), servicer, repo, keys)
    finally:
        await server.grpc.stop(0)
        await servicer.close()
        await repo.close()


def job(**fields: object) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(**{"model": "tiny", "prompt": "a lark", "width": 64, "height": 64, "steps": 2, **fields})  # type: ignore[arg-type]


def fields_named(err: grpc.aio.AioRpcError) -> list[str]:
    """The fields the refusal's BadRequest names, in order."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no rich status details"
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    return [v.field for v in bad.field_violations]


async def test_list_jobs_refuses_more_statuses_than_there_are(gateway: Gateway) -> None:
    cats = gateway.keys["cats"]
    queued = (await gateway.client.SubmitJob(job(), metadata=cats)).job_id
    many = pb.ListJobsRequest(statuses=[pb.JOB_STATUS_QUEUED] * 100_000)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gateway.client.ListJobs(many, metadata=cats)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fields_named(refused.value) == ["statuses"]
    assert len(refused.value.details() or "") < BOUNDED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gateway.client.ListJobs(pb.ListJobsRequest(page_token="A" * 2**20), metadata=cats)
    assert fields_named(refused.value) == ["page_token"]
    # A filter of a few, repeats among them, as before.
    asked = pb.ListJobsRequest(statuses=[pb.JOB_STATUS_QUEUED, pb.JOB_STATUS_RUNNING, pb.JOB_STATUS_QUEUED])
    listed = (await gateway.client.ListJobs(asked, metadata=cats)).jobs
    assert queued in {j.job_id for j in listed} and {j.status for j in listed} == {pb.JOB_STATUS_QUEUED}


async def test_a_key_of_another_form_is_refused_and_nothing_of_it_remembered(gateway: Gateway) -> None:
    remembered = gateway.servicer.gate.remembered_keys
    huge = [("authorization", "Bearer drk_" + "a" * 7000 + "_secret")]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gateway.client.GetStats(pb.GetStatsRequest(), metadata=huge)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert gateway.servicer.gate.remembered_keys == remembered
    # A key of the right form that no tenant holds: looked up (and its absence
    # remembered for a moment), refused as before.
    unknown = [("authorization", f"Bearer {api_keys.new_key().key}")]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gateway.client.GetStats(pb.GetStatsRequest(), metadata=unknown)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert gateway.servicer.gate.remembered_keys == remembered + 1


# A PNG's signature and a megabyte that no decoder takes: refused as the image only
# once something tries to decode it.
CORRUPT = b"\x89PNG\r\n\x1a\n" + b"\0" * 2**20


async def test_a_tenant_past_its_rate_is_refused_before_its_image_is_decoded(gateway: Gateway) -> None:
    larks = gateway.keys["larks"]
    await gateway.client.SubmitJob(job(), metadata=larks)  # its bucket's one submit
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gateway.client.SubmitJob(job(image=CORRUPT, strength=0.5), metadata=larks)
    quota = quota_failure(refused.value)
    assert quota.violations[0].subject == "tenant:larks" and "rate" in quota.violations[0].description
    assert len((await gateway.client.ListJobs(pb.ListJobsRequest(), metadata=larks)).jobs) == 1


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("model", {"model": "no-such-model"}),
        ("prompt", {"prompt": ""}),
        ("lane", {"lane": "vip"}),
        ("width", {"width": 100}),
        ("steps", {"steps": 1000}),
        ("mask", {"mask": CORRUPT, "image": b""}),
    ],
)
async def test_a_cheap_field_is_named_before_the_image_is_decoded(
    gateway: Gateway, field: str, change: dict[str, object]
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gateway.client.SubmitJob(job(**{"image": CORRUPT, **change}), metadata=gateway.keys["cats"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fields_named(refused.value) == [field]


async def test_an_image_is_still_decoded_once_every_other_field_is_right(gateway: Gateway) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await gateway.client.SubmitJob(job(image=CORRUPT), metadata=gateway.keys["cats"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fields_named(refused.value) == ["image"]


# A megabyte of name: longer than any id, model, lane or key this gateway takes.
HUGE = "x" * 2**20


async def refusal_of(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call  # type: ignore[misc]
    return refused.value


@pytest.mark.parametrize("method", ["GetJob", "CancelJob", "StreamJob"])
async def test_a_job_id_past_any_ids_length_is_refused_naming_it(gateway: Gateway, method: str) -> None:
    client, cats = gateway.client, gateway.keys["cats"]
    if method == "StreamJob":
        refused = await refusal_of(anext(aiter(client.StreamJob(pb.StreamJobRequest(job_id=HUGE), metadata=cats))))
    else:
        request = getattr(pb, f"{method}Request")(job_id=HUGE)
        refused = await refusal_of(getattr(client, method)(request, metadata=cats))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fields_named(refused) == ["job_id"]
    assert len(refused.details() or "") < BOUNDED


@pytest.mark.parametrize("field", ["model", "lane", "idempotency_key"])
async def test_a_submits_name_past_its_length_is_refused_naming_it(gateway: Gateway, field: str) -> None:
    refused = await refusal_of(gateway.client.SubmitJob(job(**{field: HUGE}), metadata=gateway.keys["cats"]))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fields_named(refused) == [field]
    assert len(refused.details() or "") < BOUNDED


async def test_another_tenants_job_is_not_found_and_its_images_are_never_read(gateway: Gateway) -> None:
    client, repo = gateway.client, gateway.repo
    cats, larks = gateway.keys["cats"], gateway.keys["larks"]
    job_id = (await client.SubmitJob(job(), metadata=cats)).job_id
    row = await repo.db.one(
        "UPDATE jobs SET status = 'RUNNING', worker_id = 'w1', attempt = 1 WHERE id = %s RETURNING attempt", (job_id,)
    )
    assert row is not None
    image = ImageRecord(0, b"the cats' picture", "image/png", 64, 64, 1)
    assert await repo.attempts.finish(job_id, 1, "w1", [image], now=datetime.now(UTC), busy_s=1.0)
    refused = await refusal_of(client.GetJob(pb.GetJobRequest(job_id=job_id), metadata=larks))
    assert (refused.code(), refused.details()) == (grpc.StatusCode.NOT_FOUND, f"job {job_id} not found")
    own = await client.GetJob(pb.GetJobRequest(job_id=job_id), metadata=cats)
    assert [i.data for i in own.images] == [image.data]
    # The read GetJob makes for another tenant finds the job (its refusal is logged
    # as a cross-tenant attempt) and none of its images.
    [(found, images)] = await repo.jobs.many_with_images([job_id], tenant="larks")  # type: ignore[misc]
    assert (found.tenant, images) == ("cats", [])
    [(_, images)] = await repo.jobs.many_with_images([job_id], tenant="cats")  # type: ignore[misc]
    assert [i.data for i in images] == [image.data]
