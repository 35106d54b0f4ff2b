"""A tenant's own LoRA adapters (``/v1/adapters``), over the gateway with the
caller's key: one uploaded (``adapter_upload``), those the caller may name listed
with its quota, and one of its own removed. The gateway decides whose adapter is
whose; here they take JSON's shapes."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from http_api.adapter_upload import AdapterUploads
from http_api.errors import not_found
from http_api.gateway_client import Gateway
from http_api.limits import adapter_upload_bytes
from http_api.wire import metadata_of
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

# NAME:VERSION at its longest is far shorter; a longer path segment names no adapter.
MAX_REFERENCE_CHARS = 256


class AdapterRoutes:
    def __init__(self, gateway: Gateway, max_adapter_mb: float) -> None:
        self.gateway = gateway
        self.uploads = AdapterUploads(gateway.stub, int(max_adapter_mb * 2**20), adapter_upload_bytes(max_adapter_mb))

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/adapters", self.upload),
            web.get("/v1/adapters", self.listing),
            web.delete("/v1/adapters/{name}", self.delete),
        ]

    async def upload(self, request: web.Request) -> web.Response:
        """A form of ``file`` (the .safetensors file), ``name`` and, optionally, ``base_model``."""
        return web.json_response(adapter_object(await self.uploads.upload(request, metadata_of(request))))

    async def listing(self, request: web.Request) -> web.Response:
        """The caller's own adapters, then those published to every tenant; its quota."""
        found = await self.gateway.stub.ListAdapters(
            pb.ListAdaptersRequest(), metadata=metadata_of(request), timeout=30
        )
        quota = found.quota
        return web.json_response(
            {
                "object": "list",
                "data": [adapter_object(a) for a in found.adapters],
                "quota": {
                    "adapters": quota.adapters,
                    "max_adapters": quota.max_adapters,
                    "size_bytes": quota.size_bytes,
                    "max_size_bytes": quota.max_size_bytes,
                },
            }
        )

    async def delete(self, request: web.Request) -> web.Response:
        """``NAME`` (every version) or ``NAME:VERSION`` of the caller's own (the colon may be ``%3A``)."""
        reference = request.match_info["name"]
        if not 0 < len(reference) <= MAX_REFERENCE_CHARS or not reference.isprintable():
            raise not_found("adapter")
        done = await self.gateway.stub.DeleteAdapter(
            pb.DeleteAdapterRequest(name=reference), metadata=metadata_of(request), timeout=60
        )
        return web.json_response(
            {"object": "adapter.deleted", "name": reference, "deleted": True, "removed": list(done.removed)}
        )


def adapter_object(info: pb.AdapterInfo) -> dict[str, Any]:
    return {
        "object": "adapter",
        "name": info.name,
        "version": info.version,
        "family": info.family,
        "base_model": info.base_model,
        "rank": info.rank,
        "layers": info.layers,
        "size_bytes": info.size_bytes,
        "own": info.own,
        "published": info.published,
        "created_at": info.created_time.seconds,
        "skipped": list(info.skipped),
    }
