"""The VAE decoder service: ``VaeDecoder.Decode`` turns the latents of a sampler's
batch of jobs into PNG, JPEG or WebP images (a video model's into MP4 or animated
WebP videos) and streams each back in chunks as soon as it is encoded;
``VaeDecoder.Encode`` turns an edit's input image into latents, and
``VaeDecoder.EncodePrompt`` a prompt into its conditioning for a model whose text
encoders it serves (``services.models.text_encoders``). Each output of a job
with an output policy is scored by the image filter (``vae_worker.output_checks``)
and sent as its verdict has it: as made, blurred, or not at all. Concurrent requests are decoded in batches too
(``vae_worker.decode_batches``); the heartbeat carries the decoder's load, from which
samplers pick the decoder that will finish first."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

from services.bus.credentials import NatsCredentials
from services.bus.dispatch import check_worker_id, host_token
from services.bus.events import Events
from services.bus.presence_board import BoardOnConnection
from services.config.sections import KernelSettings
from services.config.workers import DecoderSettings
from services.db.repository import Repository
from services.db.states import WorkerKind, WorkerStatus
from services.mesh.nats_auth import DECODER_USER
from services.mesh.rpc import MeshIdentity
from services.models.device import pick_device
from services.models.encoding import encode_output
from services.models.prompt_encoding import PromptParams
from services.models.text_encoders import PromptRequest, TextEncoderEngine
from services.models.vae import DecodedImage, VaeDecoderEngine, latents_from_bytes
from services.ops.host import Closing, GrpcServer, JetStream, Metrics, Migrations, Part, Registered, host
from services.ops.lifecycle import EXIT_UNFIT, run_service
from services.presence import Heartbeat, Presence
from services.rpc.chunks import split
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.gen.darkroom.internal.v1.vae_decoder_pb2 import DecodeJob
from services.rpc.server import Server, build_server
from services.rpc.status import stream_errors, unary_errors
from services.safety.image_filter import NO_FILTER, image_filter_of, unchecked
from services.safety.verdicts import BLURRED, Judged, verdict
from services.telemetry import logs
from services.telemetry.gpu import Telemetry
from vae_worker import spans
from vae_worker.decode_batches import DecodeBatcher
from vae_worker.metrics import PROMPT_ENCODES, TEXT_ENCODER_BYTES
from vae_worker.output_checks import OutputChecks
from vae_worker.requests import check_encode, check_jobs, encoded, outputs_to_check

log = logging.getLogger(__name__)


class VaeDecoderServicer(vae_decoder_pb2_grpc.VaeDecoderServicer):
    def __init__(
        self, batcher: DecodeBatcher, checks: OutputChecks | None = None, encoders: TextEncoderEngine | None = None
    ) -> None:
        self.batcher = batcher
        # None: the image filter is off here; a job whose outputs are to be checked fails.
        self.checks = checks
        engine = batcher.engine
        self.encoders = encoders or TextEncoderEngine(engine.registry, engine.models_dir, engine.device, 0)

    @stream_errors
    async def Decode(
        self, request: vae_decoder_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vae_decoder_pb2.DecodeChunk]:
        started_ns = time.time_ns()
        latents = latents_from_bytes(request.latents, list(request.shape), request.dtype or "float32")
        video = latents.dim() == 5
        jobs = check_jobs(request.jobs, int(latents.shape[0]), video=video)
        images = await self.batcher.decode(request.model, latents)
        # Each job's images, or why it has none: one bad image fails its job alone.
        sliced: list[tuple[int, DecodeJob, list[DecodedImage]]] = []
        start = 0
        for index, (job, _) in enumerate(jobs):
            own = images[start : start + job.images]
            start += job.images
            what = "video" if video else "image"
            fault = next((f"{what} {i}: {image.fault}" for i, image in enumerate(own) if image.fault), "")
            if not fault and job.output_policy and self.checks is None:
                fault = NO_FILTER
            if fault:
                log.warning("job %s: %s", job.job_id or "?", fault, extra=logs.job_fields(job.job_id))
                spans.decoded(job.traceparent, job.job_id, start_ns=started_ns, error=fault)
                yield vae_decoder_pb2.DecodeChunk(job=index, last=True, error=fault)
            else:
                sliced.append((index, job, own))
        # Scored while they are encoded (and while the next batch decodes); nothing
        # of a checked output is sent before its verdict.
        checked = {(index, i): n for n, (index, i) in enumerate(outputs_to_check(sliced))}
        scoring = None
        if checked and self.checks is not None:
            pixels = [image.pixels for _, job, own in sliced if job.output_policy for image in own]  # as in checked
            scoring = asyncio.ensure_future(self.checks.scores(pixels))
        refused: set[int] = set()
        try:
            async for index, job, image_index, image, mime_type, data in encoded(sliced, dict(enumerate(jobs))):
                if index in refused:
                    continue
                score = None
                if scoring is not None and (index, image_index) in checked:
                    try:
                        score = (await scoring)[checked[(index, image_index)]]
                    except Exception as exc:
                        # Failed closed: every job still to be checked fails (to be
                        # retried elsewhere), none is sent unchecked.
                        error = f"the image filter failed: {type(exc).__name__}: {exc}"
                        log.exception("%s", error)
                        for failing in sorted({i for i, _ in checked} - refused):
                            refused.add(failing)
                            yield vae_decoder_pb2.DecodeChunk(job=failing, last=True, error=error)
                        continue
                judged = await self._judged(image.pixels, job.output_policy, score)
                if judged.pixels is None:
                    data = b""
                elif judged.pixels is not image.pixels:
                    data = await asyncio.to_thread(encode_output, judged.pixels, mime_type, job.fps)
                height, width = image.pixels.shape[-3:-1]
                frames = image.pixels.shape[0] if video else 1
                for offset, part, last in split(data):
                    yield vae_decoder_pb2.DecodeChunk(
                        job=index,
                        index=image_index,
                        offset=offset,
                        data=part,
                        last=last,
                        width=width,
                        height=height,
                        mime_type=mime_type,
                        frames=frames,
                        nsfw_score=judged.nsfw_score,
                        verdict=judged.verdict,
                    )
                if image_index == job.images - 1:
                    spans.decoded(job.traceparent, job.job_id, start_ns=started_ns)
        finally:
            if scoring is not None:
                scoring.cancel()

    async def _judged(self, pixels: np.ndarray, policy: str, score: float | None) -> Judged:
        """The output as its verdict has it returned; a blur (PIL, tens of ms at 1024
        px) off the event loop."""
        if self.checks is None or score is None:
            return unchecked(pixels)
        image_filter = self.checks.filter
        if verdict(policy, score, image_filter.threshold) == BLURRED:
            return await asyncio.to_thread(image_filter.judge, pixels, policy, score)
        return image_filter.judge(pixels, policy, score)

    @unary_errors
    async def Encode(
        self, request: vae_decoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> vae_decoder_pb2.EncodeResponse:
        check_encode(request)
        engine = self.batcher.engine
        with logs.about_job(request.job_id):
            latents = await asyncio.to_thread(
                engine.encode_image, request.model, request.image, request.width, request.height
            )
        array = latents.contiguous().numpy()
        return vae_decoder_pb2.EncodeResponse(latents=array.astype("<f4").tobytes(), shape=list(array.shape))

    @unary_errors
    async def EncodePrompt(
        self, request: vae_decoder_pb2.EncodePromptRequest, context: grpc.aio.ServicerContext
    ) -> vae_decoder_pb2.EncodePromptResponse:
        self.encoders.check_model(request.model)  # an unknown model is refused before any wait
        params = PromptParams(request.prompt, request.negative_prompt, request.width, request.height)
        size = (request.image_width, request.image_height)
        asked = PromptRequest(request.model, params, request.guided, request.image, size)
        with logs.about_job(request.job_id):
            data, cached = await asyncio.to_thread(self.encoders.encode, asked)
        PROMPT_ENCODES.labels(model=request.model, cached=str(cached).lower()).inc()
        TEXT_ENCODER_BYTES.set(self.encoders.held_bytes())
        return vae_decoder_pb2.EncodePromptResponse(conditioning=data, cached=cached)


def batcher_for(settings: DecoderSettings, engine: VaeDecoderEngine) -> DecodeBatcher:
    return DecodeBatcher(engine, wait_s=settings.batch_wait_ms / 1000.0, max_images=settings.max_batch)


# Who may call a decoder, where the mesh is sealed.
DECODER_CALLERS = {"darkroom.internal.v1.VaeDecoder": frozenset({"sampler"})}


def create_server(
    settings: DecoderSettings,
    batcher: DecodeBatcher,
    mesh: MeshIdentity | None = None,
    checks: OutputChecks | None = None,
    encoders: TextEncoderEngine | None = None,
) -> Server:
    """The VaeDecoder gRPC server (not started); port 0 picks a free port.
    ``checks``: the image filter (None: off, and jobs to be checked fail);
    ``encoders``: the text encoders it serves (None: a cache of the settings' size)."""
    encoders = encoders or TextEncoderEngine(
        batcher.engine.registry, batcher.engine.models_dir, batcher.engine.device, settings.prompt_cache_mb * 2**20
    )
    servicer = VaeDecoderServicer(batcher, checks, encoders)
    return build_server(
        [
            (
                lambda s: vae_decoder_pb2_grpc.add_VaeDecoderServicer_to_server(servicer, s),
                "darkroom.internal.v1.VaeDecoder",
            )
        ],
        settings.host,
        settings.port,
        mesh=mesh,
        roles=DECODER_CALLERS,
    )


async def serve(kernel: KernelSettings, settings: DecoderSettings, stop: asyncio.Event) -> int:
    registry = kernel.registry()
    device = pick_device(settings.device)
    engine = VaeDecoderEngine.from_settings(settings.decode, registry, kernel.models_dir, device)
    for name in settings.preload_models:
        await asyncio.to_thread(engine.load, name)
    image_filter = await image_filter_of(kernel.safety, device)
    checks = OutputChecks(image_filter) if image_filter is not None else None
    worker_id = check_worker_id(settings.worker_id or f"{host_token()}-decoder-{settings.port or os.getpid()}")
    repo = Repository(
        kernel.database_url,
        pool_size=1,
        application_name=f"darkroom-decoder-{worker_id}",
        pooled=kernel.database_pooled,
    )
    batcher = batcher_for(settings, engine)
    # The text encoders of the models whose registry entry says "service": this
    # process, already started, sealed, supervised and scaled per GPU, serves them too.
    encoders = TextEncoderEngine(registry, kernel.models_dir, device, settings.prompt_cache_mb * 2**20)
    server = create_server(settings, batcher, MeshIdentity.of(kernel.mesh_dir, "decoder"), checks, encoders)
    address = f"{settings.host}:{server.port}"
    telemetry = Telemetry((device.index or 0) if device.type == "cuda" else None)
    heartbeat = Heartbeat(
        WorkerKind.DECODER,
        worker_id,
        address,
        engine,
        telemetry,
        kernel.restarts,
        lambda: {**batcher.telemetry(), **encoders.telemetry()},
    )
    credentials = NatsCredentials.of(kernel.mesh_dir, "decoder", DECODER_USER)
    # Its heartbeats go on NATS; it consumes nothing there.
    nats = JetStream(
        kernel, connection_name=f"darkroom-decoder-{worker_id}", credentials=credentials, manages_stream=False
    )
    board = BoardOnConnection(nats.connection, replicas=kernel.nats_replicas, create=credentials is None)
    # No jobs of its own: nothing to publish as it registers or deregisters.
    presence = Presence(
        repo.workers,
        board,
        worker_id,
        heartbeat,
        Events(),
        interval_s=kernel.heartbeat_interval_s,
        status=WorkerStatus.READY,
        on_superseded=stop.set,
    )
    parts: list[Part] = [
        Metrics(kernel, "decoder"),
        Migrations(kernel),
        Closing("database", repo.close),
        nats,
        GrpcServer(server, grace_s=kernel.shutdown_grace_s),
        Registered(presence),
    ]

    async def work() -> int:
        log.info("decoder %s on %s listening on %s", worker_id, device, address)
        await presence.run(until=stop)
        return EXIT_UNFIT if presence.superseded.is_set() else 0

    return await host(parts, work, stop)


def main() -> None:
    run_service("decoder", serve, DecoderSettings)
