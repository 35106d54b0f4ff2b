"""Tenants' own LoRA adapters through a running stack, a real model store
(seaweedfs) and real tenants: a tenant uploads one over gRPC, checked before
anything is stored, and its jobs name it; it is private (another tenant's request
and removal are refused exactly as for a name that does not exist, or for a
model's); listing shows a tenant its own and the published ones; an operator
publishes it (`darkroom adapters publish`) and every tenant's jobs may name it;
quotas bound what a tenant keeps (the same bytes again are no new version); removal
takes it out of the store and gives the room back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.api_keys import new_key
from services.db.repository import Repository
from services.db.tenant_records import TenantTerms
from services.models.store.push import push_directory
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from tests.conftest import make_stack, running
from tests.helpers import cli_here, count_jobs, quota_failure, store_values, stub, wait_terminal
from tests.integration.test_host_cache import object_store
from tests.integration.test_invalid_requests import violations
from tests.lora_files import attention_layers, write_diffusers_lora

pytestmark = pytest.mark.integration

TENANTS = {
    "acme": TenantTerms("free", max_adapters=1),  # at most one adapter version
    "beta": TenantTerms("free"),
    "slow": TenantTerms("free", rate_per_s=0.001),  # one call, then none for 1,000 s
}


def as_key(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path, model_store: Any
) -> Iterator[LocalStack]:
    yield from running(
        make_stack(
            tmp_path_factory.mktemp("tenant-adapters"),
            postgres,
            models_dir,
            max_adapter_mb=1.0,
            **store_values(model_store),  # the gateway with its own identity, as `darkroom up --model-store`
        )
    )


@pytest.fixture(scope="module")
def keys(stack: LocalStack) -> dict[str, str]:
    """A key for each tenant, made in the stack's database."""

    async def make() -> dict[str, str]:
        repo = Repository(stack.settings.kernel.database_url, pool_size=1)
        try:
            made = {}
            for name, terms in TENANTS.items():
                now = datetime.now(UTC)
                await repo.tenants.create(name, terms, actor="test", now=now)
                issued = new_key()
                await repo.tenants.add_key(name, issued, admin=False, actor="test", now=now)
                made[name] = issued.key
            return made
        finally:
            await repo.close()

    return asyncio.run(make())


@pytest.fixture(scope="module")
def files(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter files for the miniature: two that fit it, one of too high a rank, one not a LoRA."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet")
    root = tmp_path_factory.mktemp("tenant-lora")
    layers = attention_layers(unet)
    made = {
        "style": write_diffusers_lora(root / "style", unet, layers, rank=4, seed=21),
        "other": write_diffusers_lora(root / "other", unet, layers, rank=4, seed=22),
        "wide": write_diffusers_lora(root / "wide", unet, layers, rank=32, seed=23),  # tiny takes 16 at most
    }
    files = {name: directory / "pytorch_lora_weights.safetensors" for name, directory in made.items()}
    files["junk"] = root / "junk.safetensors"
    files["junk"].write_bytes(os.urandom(4096))
    return files


def upload(
    stack: LocalStack, key: str, path: Path, name: str, *, base: str = "tiny", size: int | None = None
) -> pb.AdapterInfo:
    data = path.read_bytes()

    def messages() -> Iterator[pb.UploadAdapterRequest]:
        header = pb.AdapterUpload(name=name, base_model=base, size_bytes=len(data) if size is None else size)
        yield pb.UploadAdapterRequest(header=header)
        for i in range(0, len(data), 16 * 1024):
            yield pb.UploadAdapterRequest(chunk=data[i : i + 16 * 1024])

    return stub(stack).UploadAdapter(messages(), metadata=as_key(key), timeout=120)


def listed(stack: LocalStack, key: str) -> pb.ListAdaptersResponse:
    return stub(stack).ListAdapters(pb.ListAdaptersRequest(), metadata=as_key(key))


def image(stack: LocalStack, key: str, *adapters: pb.Adapter) -> pb.Job:
    client = stub(stack)
    request = pb.SubmitJobRequest(model="tiny", prompt="a lighthouse", steps=3, seed=7, adapters=adapters)
    job = wait_terminal(client, client.SubmitJob(request, metadata=as_key(key)).job_id, metadata=as_key(key))
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    return job


def refusal(stack: LocalStack, key: str, name: str) -> str:
    """How the gateway refuses a job naming ``name``, the name itself taken out."""
    with pytest.raises(grpc.RpcError) as refused:
        request = pb.SubmitJobRequest(model="tiny", prompt="x", adapters=[pb.Adapter(name=name)])
        stub(stack).SubmitJob(request, metadata=as_key(key))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(refused.value)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    [violation] = bad.field_violations
    assert violation.field == "adapters[0].name"
    return violation.description.replace(repr(name), "NAME")


def tenant_store(model_store: Any, tenant: str) -> list[str]:
    """What the store holds of ``tenant``'s own, as the operator lists it."""
    return [
        f"{v.name}:{v.version}" for v in object_store(model_store).scoped(f"tenants/tenant.{tenant}/").list_models()
    ]


def test_a_tenants_adapter_is_its_own_until_an_operator_publishes_it(
    stack: LocalStack, keys: dict[str, str], files: dict[str, Path], model_store: Any, tmp_path: Path
) -> None:
    info = upload(stack, keys["acme"], files["style"], "style")
    assert (info.name, info.family, info.base_model, info.rank, info.own, info.published) == (
        "style", "tiny", "tiny", 4, True, False
    )  # fmt: skip
    assert len(info.version) == 12 and info.size_bytes == files["style"].stat().st_size
    again = upload(stack, keys["acme"], files["style"], "style")  # the same bytes: the same version, kept once
    assert again.version == info.version
    assert tenant_store(model_store, "acme") == [f"tenant.acme.style:{info.version}"]
    mine = listed(stack, keys["acme"])
    assert [(a.name, a.own) for a in mine.adapters if a.name == "style"] == [("style", True)]
    assert (mine.quota.adapters, mine.quota.size_bytes) == (1, info.size_bytes)
    assert "style" not in [a.name for a in listed(stack, keys["beta"]).adapters]

    plain = image(stack, keys["acme"])
    styled = image(stack, keys["acme"], pb.Adapter(name="style", scale=1.5))
    assert [(a.name, a.scale) for a in styled.adapters] == [(f"style:{info.version}", 1.5)]
    assert styled.images[0].data != plain.images[0].data

    # Another tenant is refused the name as if nothing had it, with or without its
    # version: as for a name no one has, and for one of the store's models.
    unknown = refusal(stack, keys["beta"], "no-such-adapter")
    assert refusal(stack, keys["beta"], "style") == unknown
    assert refusal(stack, keys["beta"], f"style:{info.version}") == unknown
    model = tmp_path / "a-model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    a_model = push_directory(object_store(model_store), model, f"a-model-{uuid.uuid4().hex[:6]}").manifest.name
    assert refusal(stack, keys["beta"], a_model) == unknown
    with pytest.raises(grpc.RpcError) as not_yours:
        stub(stack).DeleteAdapter(pb.DeleteAdapterRequest(name="style"), metadata=as_key(keys["beta"]))
    with pytest.raises(grpc.RpcError) as nothing:
        stub(stack).DeleteAdapter(pb.DeleteAdapterRequest(name="nothing"), metadata=as_key(keys["beta"]))
    assert not_yours.value.code() == nothing.value.code() == grpc.StatusCode.NOT_FOUND
    assert not_yours.value.details().replace("'style'", "NAME") == nothing.value.details().replace("'nothing'", "NAME")

    published = darkroom(stack, "adapters", "publish", "acme", "style")
    assert published.returncode == 0 and "published" in published.stdout, published.stderr
    theirs = listed(stack, keys["beta"])
    assert [(a.name, a.own, a.published) for a in theirs.adapters if a.name == "style"] == [("style", False, True)]
    borrowed = image(stack, keys["beta"], pb.Adapter(name="style", scale=1.5))
    assert borrowed.images[0].data == styled.images[0].data  # the same bytes, the same image
    assert darkroom(stack, "adapters", "unpublish", "acme", "style").returncode == 0
    assert refusal(stack, keys["beta"], "style") == unknown

    # At its limit of one version: another is refused before it is checked, nothing kept.
    with pytest.raises(grpc.RpcError) as full:
        upload(stack, keys["acme"], files["other"], "other")
    [violation] = quota_failure(full.value).violations
    assert violation.subject == "tenant:acme" and violation.description.startswith("max_adapters")
    assert tenant_store(model_store, "acme") == [f"tenant.acme.style:{info.version}"]

    removed = stub(stack).DeleteAdapter(pb.DeleteAdapterRequest(name="style"), metadata=as_key(keys["acme"]))
    assert list(removed.removed) == [f"style:{info.version}"]
    assert refusal(stack, keys["acme"], "style") == unknown
    assert tenant_store(model_store, "acme") == []
    room = listed(stack, keys["acme"]).quota
    assert (room.adapters, room.max_adapters) == (0, 1)  # room again for one


def test_bad_uploads_are_refused_by_field_and_nothing_is_kept(
    stack: LocalStack, keys: dict[str, str], files: dict[str, Path], model_store: Any
) -> None:
    key, before, details = keys["beta"], count_jobs(stack), {}
    for given, field in (
        (dict(path=files["style"], name="a.b"), "name"),
        (dict(path=files["style"], name="ok", base="no-such-model"), "base_model"),
        (dict(path=files["style"], name="ok", base="tiny-wan"), "base_model"),  # takes no adapters
        (dict(path=files["style"], name="ok", size=2 * 2**20), "size_bytes"),  # past DARKROOM_MAX_ADAPTER_MB
        (dict(path=files["style"], name="ok", size=files["style"].stat().st_size + 1), "size_bytes"),
        (dict(path=files["wide"], name="wide"), "file"),
        (dict(path=files["junk"], name="junk"), "file"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            upload(stack, key, **given)  # type: ignore[arg-type]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert field in violations(refused.value), refused.value.details()
        details[given["name"]] = refused.value.details() or ""
    assert "rank is 32" in details["wide"]
    quota = listed(stack, key).quota
    assert (quota.adapters, quota.size_bytes) == (0, 0)
    assert tenant_store(model_store, "beta") == []
    assert count_jobs(stack) == before


def test_a_tenant_past_its_limits_has_no_adapter_looked_up(stack: LocalStack, keys: dict[str, str]) -> None:
    """Names come from clients: none is looked up (in the database, or in the store
    in a thread) for a tenant its limits refuse now."""
    key = keys["slow"]
    image(stack, key)  # its one call
    with pytest.raises(grpc.RpcError) as refused:
        request = pb.SubmitJobRequest(model="tiny", prompt="x", adapters=[pb.Adapter(name="never-looked-up")])
        stub(stack).SubmitJob(request, metadata=as_key(key))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert quota_failure(refused.value).violations[0].subject == "tenant:slow"


def darkroom(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DARKROOM_DATABASE_URL": stack.settings.kernel.database_url}
    return cli_here(env, *args)


async def test_an_upload_s_header_is_answered_before_its_file_is_sent(stack: LocalStack, keys: dict[str, str]) -> None:
    """The call's initial metadata accepts the header; a refused header ends the call
    with its refusal instead. A client that waits for it (the HTTP door does) never
    has a write in flight as the call ends, which gRPC reports as its own INTERNAL,
    the refusal lost."""

    def header(name: str) -> pb.UploadAdapterRequest:
        return pb.UploadAdapterRequest(header=pb.AdapterUpload(name=name, base_model="tiny", size_bytes=100))

    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        client = image_generation_pb2_grpc.ImageGenerationStub(channel)
        accepted = client.UploadAdapter(metadata=as_key(keys["beta"]), timeout=30)
        await accepted.write(header("early"))
        await asyncio.wait_for(accepted.initial_metadata(), 10)
        assert not accepted.done()  # waiting for the file
        accepted.cancel()
        refused = client.UploadAdapter(metadata=as_key(keys["beta"]), timeout=30)
        await refused.write(header("a.b"))
        await asyncio.wait_for(refused.initial_metadata(), 10)
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await refused
    assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "name" in violations(refusal.value)
