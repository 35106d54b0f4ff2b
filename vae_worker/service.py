"""The VAE decoder service: ``VaeDecoder.Decode`` turns latents into PNGs and streams
them back in chunks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import grpc

from gpu_worker.engine import pick_device
from services.bus import host_token
from services.chunks import split
from services.db.migrate import upgrade
from services.db.repository import Repository, WorkerHeartbeat
from services.errors import StoreError
from services.lifecycle import run_service
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.server import build_server
from services.rpc.status import stream_errors
from services.settings import Settings
from vae_worker.decoder import VaeDecoderEngine, encode_png, latents_from_bytes

log = logging.getLogger("darkroom.vae_worker")


class VaeDecoderServicer(vae_decoder_pb2_grpc.VaeDecoderServicer):
    def __init__(self, engine: VaeDecoderEngine) -> None:
        self.engine = engine

    @stream_errors
    async def Decode(
        self, request: vae_decoder_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vae_decoder_pb2.DecodeChunk]:
        latents = latents_from_bytes(request.latents, list(request.shape), request.dtype or "float32")
        images = await asyncio.to_thread(self.engine.decode, request.model, latents)
        for index, pixels in enumerate(images):
            png = await asyncio.to_thread(encode_png, pixels)
            height, width = pixels.shape[:2]
            for offset, data, last in split(png):
                yield vae_decoder_pb2.DecodeChunk(
                    index=index,
                    offset=offset,
                    data=data,
                    last=last,
                    width=width,
                    height=height,
                    mime_type="image/png",
                )


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    await asyncio.to_thread(upgrade, settings.database_url)
    registry = ModelRegistry.load(settings.model_registry or None)
    device = pick_device(settings.device)
    engine = VaeDecoderEngine(registry, settings.models_dir, device)
    for name in settings.preload_models:
        await asyncio.to_thread(engine.load, name)
    worker_id = f"vae-{host_token()}-{os.getpid()}"
    repo = Repository(settings.database_url, pool_size=2)
    server = build_server(
        [
            (
                lambda s: vae_decoder_pb2_grpc.add_VaeDecoderServicer_to_server(VaeDecoderServicer(engine), s),
                "darkroom.internal.v1.VaeDecoder",
            )
        ],
        settings.vae_host,
        settings.vae_port,
    )
    address = f"{settings.vae_host}:{server.port}"
    try:
        await server.grpc.start()
        await server.set_serving(True)
        log.info("vae_worker %s on %s listening on %s", worker_id, device, address)
        while not stop.is_set():
            try:
                await repo.heartbeat(
                    WorkerHeartbeat(
                        id=worker_id,
                        kind="vae",
                        address=address,
                        device=str(device),
                        models=tuple(registry.names()),
                        warm_models=tuple(engine.warm_models()),
                    ),
                    now=datetime.now(UTC),
                )
            except StoreError as exc:
                log.warning("heartbeat failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.heartbeat_interval_s)
        with contextlib.suppress(StoreError):
            await repo.remove_worker(worker_id)
    finally:
        await server.grpc.stop(settings.shutdown_grace_s)
        await repo.close()


def main() -> None:
    run_service("vae_worker", serve)
