"""The public API's adapter calls (``UploadAdapter``, ``ListAdapters``,
``DeleteAdapter``), a part of ``ImageGenerationServicer``: each caller sees, names
and removes only its own adapters and the published ones."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime

import grpc

from gateway.adapters import AdapterResolver
from gateway.auth import Gatekeeper
from gateway.convert import timestamp
from gateway.tenant_adapters import TenantAdapters
from services.db.adapter_records import TenantAdapter
from services.models.store.manifest import Manifest
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.status import unary_errors


def adapter_info(adapter: TenantAdapter, tenant: str) -> pb.AdapterInfo:
    info = pb.AdapterInfo(
        name=adapter.name,
        version=adapter.version,
        family=adapter.family,
        base_model=adapter.base_model,
        rank=adapter.rank,
        layers=adapter.layers,
        size_bytes=adapter.size_bytes,
        own=adapter.tenant == tenant,
        published=adapter.published,
        skipped=list(adapter.skipped),
    )
    info.created_time.CopyFrom(timestamp(adapter.created_at))
    return info


def stored_info(manifest: Manifest, pushed_at: datetime) -> pb.AdapterInfo:
    """An operator's adapter of the model store: published to every tenant."""
    entry = manifest.entry
    info = pb.AdapterInfo(
        name=manifest.name,
        version=manifest.version,
        family=str(entry.get("family", "")),
        base_model=str(entry.get("base", "")),
        rank=int(entry.get("rank", 0)),
        layers=int(entry.get("layers", 0)),
        size_bytes=manifest.total_bytes,
        own=False,
        published=True,
        skipped=[str(s) for s in entry.get("skipped", ())],
    )
    info.created_time.CopyFrom(timestamp(pushed_at))
    return info


class AdapterRpcs:
    """Mixed into the servicer, which sets ``gate``, ``adapters`` and ``tenant_adapters``."""

    gate: Gatekeeper
    adapters: AdapterResolver
    tenant_adapters: TenantAdapters

    @unary_errors
    async def UploadAdapter(
        self, request_iterator: AsyncIterator[pb.UploadAdapterRequest], context: grpc.aio.ServicerContext
    ) -> pb.AdapterInfo:
        caller = await self.gate.caller(context, "UploadAdapter")
        # The call's initial metadata answers the header: the file may come.
        adapter = await self.tenant_adapters.upload(caller, request_iterator, lambda: context.send_initial_metadata(()))
        return adapter_info(adapter, caller.tenant)

    @unary_errors
    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        caller = await self.gate.caller(context, "ListAdapters")
        tenants = await self.tenant_adapters.repo.adapters.listing(caller.tenant)
        stored = await self.adapters.catalog.listing()
        usage = await self.tenant_adapters.repo.adapters.usage(caller.tenant)
        limits = self.tenant_adapters.limits(caller)
        quota = pb.AdapterQuota(
            adapters=usage.adapters,
            max_adapters=limits.max_adapters,
            size_bytes=usage.size_bytes,
            max_size_bytes=limits.max_bytes,
        )
        return pb.ListAdaptersResponse(
            adapters=[adapter_info(a, caller.tenant) for a in tenants] + [stored_info(m, at) for m, at in stored],
            quota=quota,
        )

    @unary_errors
    async def DeleteAdapter(
        self, request: pb.DeleteAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteAdapterResponse:
        caller = await self.gate.caller(context, "DeleteAdapter")
        removed = await self.tenant_adapters.remove(caller, request.name)
        return pb.DeleteAdapterResponse(removed=[a.reference for a in removed])
