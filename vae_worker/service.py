"""The VAE decoder service: ``VaeDecoder.Decode`` turns latents into PNG, JPEG or
WebP images and streams each back in chunks as soon as it is encoded. Concurrent
requests are decoded in batches (``vae_worker.batcher``); the heartbeat carries the
decoder's load, from which samplers pick the decoder that will finish first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np

from services import tracing
from services.bus import check_worker_id, host_token
from services.chunks import split
from services.db.migrate import upgrade_when_reachable
from services.db.records import WorkerHeartbeat
from services.db.repository import Repository
from services.db.states import WorkerKind
from services.errors import DegenerateOutput, StoreError, WorkerSuperseded
from services.lifecycle import EXIT_UNFIT, run_service
from services.metrics import observe_gpu, serve_metrics
from services.models.device import pick_device
from services.models.encoding import check_mime_type, encode
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine, latents_from_bytes
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.server import Server, build_server
from services.rpc.status import stream_errors
from services.settings import Settings
from services.telemetry import Telemetry
from vae_worker.batcher import DecodeBatcher

log = logging.getLogger("darkroom.vae_worker")


class VaeDecoderServicer(vae_decoder_pb2_grpc.VaeDecoderServicer):
    def __init__(self, batcher: DecodeBatcher) -> None:
        self.batcher = batcher

    @stream_errors
    @tracing.serves(tracing.DECODE)
    async def Decode(
        self, request: vae_decoder_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vae_decoder_pb2.DecodeChunk]:
        mime_type = check_mime_type(request.mime_type)
        latents = latents_from_bytes(request.latents, list(request.shape), request.dtype or "float32")
        images = await self.batcher.decode(request.model, latents)
        for index, image in enumerate(images):
            if image.fault:
                raise DegenerateOutput(f"job {request.job_id or '?'} image {index}: {image.fault}")

        async def encoded(index: int, pixels: np.ndarray) -> tuple[int, bytes]:
            return index, await asyncio.to_thread(encode, pixels, mime_type)

        encodings = [asyncio.ensure_future(encoded(i, image.pixels)) for i, image in enumerate(images)]
        try:
            for next_done in asyncio.as_completed(encodings):
                index, data = await next_done
                height, width = images[index].pixels.shape[:2]
                for offset, part, last in split(data):
                    yield vae_decoder_pb2.DecodeChunk(
                        index=index,
                        offset=offset,
                        data=part,
                        last=last,
                        width=width,
                        height=height,
                        mime_type=mime_type,
                    )
        finally:
            for task in encodings:
                task.cancel()


def batcher_for(settings: Settings, engine: VaeDecoderEngine) -> DecodeBatcher:
    return DecodeBatcher(engine, wait_s=settings.decode_batch_wait_ms / 1000.0, max_images=settings.decode_max_batch)


def create_server(settings: Settings, batcher: DecodeBatcher) -> Server:
    """The VaeDecoder gRPC server (not started); port 0 picks a free port."""
    servicer = VaeDecoderServicer(batcher)
    return build_server(
        [
            (
                lambda s: vae_decoder_pb2_grpc.add_VaeDecoderServicer_to_server(servicer, s),
                "darkroom.internal.v1.VaeDecoder",
            )
        ],
        settings.vae_host,
        settings.vae_port,
    )


async def serve(settings: Settings, stop: asyncio.Event) -> int:
    serve_metrics(settings, "vae_worker")
    if not await upgrade_when_reachable(settings.database_url, stop):
        return 0
    registry = ModelRegistry.load(settings.model_registry or None)
    device = pick_device(settings.device)
    engine = VaeDecoderEngine.from_settings(settings, registry, device)
    for name in settings.preload_models:
        await asyncio.to_thread(engine.load, name)
    worker_id = check_worker_id(settings.worker_id or f"{host_token()}-vae-{settings.vae_port or os.getpid()}")
    incarnation = str(uuid.uuid4())
    repo = Repository(settings.database_url, pool_size=2, application_name=f"darkroom-decoder-{worker_id}")
    batcher = batcher_for(settings, engine)
    server = create_server(settings, batcher)
    address = f"{settings.vae_host}:{server.port}"

    gpu = Telemetry((device.index or 0) if device.type == "cuda" else None)

    def reading() -> WorkerHeartbeat:
        card = gpu.read()
        observe_gpu(worker_id, card)
        return WorkerHeartbeat(
            id=worker_id,
            kind=WorkerKind.DECODER,
            address=address,
            device=card.name if card.source == "nvml" else str(device),
            models=tuple(registry.names()),
            warm_models=tuple(engine.warm_models()),
            vram_total_bytes=card.vram_total_bytes,
            vram_used_bytes=card.vram_used_bytes,
            temperature_c=card.temperature_c,
            restarts=settings.restarts,
            telemetry={**card.as_dict(), **batcher.telemetry()},
        )

    registered = False
    try:
        await server.grpc.start()
        await server.set_serving(True)
        log.info("vae_worker %s on %s listening on %s", worker_id, device, address)
        while not stop.is_set():
            try:
                if registered:
                    await repo.workers.heartbeat(reading(), incarnation)
                else:
                    await repo.workers.register(reading(), incarnation)
                    registered = True
            except WorkerSuperseded as exc:
                log.error("%s; stopping", exc)
                return EXIT_UNFIT
            except StoreError as exc:
                log.warning("heartbeat failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.heartbeat_interval_s)
        with contextlib.suppress(StoreError):
            await repo.workers.deregister(worker_id, incarnation)
        return 0
    finally:
        await server.grpc.stop(settings.shutdown_grace_s)
        await repo.close()


def main() -> None:
    run_service("vae_worker", serve)
