"""The sampler service: one process per GPU. Pulls its jobs from its own JetStream
subject, runs the denoising loop, has the latents decoded by a vae_worker, stores
the result and only then acks the message."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import grpc
import torch
from nats.errors import TimeoutError as NatsTimeoutError

from gpu_worker.engine import SamplerEngine, SampleRequest, pick_device
from gpu_worker.tracker import JobTracker, JobWatch
from scheduler.estimates import Shape, observe
from scheduler.views import durations_from
from services.bus import Bus, Dispatch, host_token
from services.chunks import split
from services.db.migrate import upgrade
from services.db.models import JobStatus
from services.db.repository import Estimate, ImageRecord, JobRecord, Repository, WarmPlan, WorkerHeartbeat
from services.errors import DarkroomError, JobCancelled, NotFound, StoreError
from services.lifecycle import run_service
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.internal.v1 import (
    sampler_pb2,
    sampler_pb2_grpc,
    vae_decoder_pb2,
    vae_decoder_pb2_grpc,
)
from services.rpc.server import build_server, channel
from services.rpc.status import stream_errors, unary_errors
from services.settings import Settings
from services.telemetry import Telemetry

log = logging.getLogger("darkroom.gpu_worker")

# A running job's message is kept from redelivery by telling JetStream it is in
# progress this often (well inside the consumer's ack wait).
IN_PROGRESS_EVERY_S = 10.0
# Progress is written to Postgres at most this often; the gRPC stream gets every step.
PROGRESS_WRITE_EVERY_S = 0.25
VAE_WAIT_S = 30.0


def default_worker_id(device: torch.device) -> str:
    suffix = f"gpu{device.index or 0}" if device.type == "cuda" else "cpu"
    return f"{host_token()}-{suffix}-{os.getpid()}"


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    def __init__(self, tracker: JobTracker) -> None:
        self.tracker = tracker

    @stream_errors
    async def WatchJob(
        self, request: sampler_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sampler_pb2.SamplerEvent]:
        watch = self.tracker.get(request.job_id)
        if watch is None:
            raise NotFound(f"job {request.job_id} is not on this worker")
        async for event in watch.follow():
            yield event

    @unary_errors
    async def CancelJob(
        self, request: sampler_pb2.SamplerCancelRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.SamplerCancelResponse:
        watch = self.tracker.get(request.job_id)
        if watch is None or watch.finished_at is not None:
            return sampler_pb2.SamplerCancelResponse(was_running=False)
        watch.cancelled.set()
        return sampler_pb2.SamplerCancelResponse(was_running=True)


def latents_to_request(job: JobRecord, latents: torch.Tensor) -> vae_decoder_pb2.DecodeRequest:
    array = latents.detach().to("cpu", torch.float32).contiguous().numpy()
    return vae_decoder_pb2.DecodeRequest(
        model=job.model,
        latents=array.astype("<f4").tobytes(),
        shape=list(array.shape),
        dtype="float32",
        mime_type="image/png",
        job_id=job.id,
    )


class GpuWorker:
    def __init__(
        self,
        settings: Settings,
        repo: Repository,
        bus: Bus,
        engine: SamplerEngine,
        worker_id: str,
        address: str,
        telemetry: Telemetry,
        tracker: JobTracker,
    ) -> None:
        self.settings = settings
        self.repo = repo
        self.bus = bus
        self.engine = engine
        self.worker_id = worker_id
        self.address = address
        self.telemetry = telemetry
        self.tracker = tracker
        self._vae_round_robin = itertools.count()
        self._vae_channels: dict[str, grpc.aio.Channel] = {}
        self.plan = WarmPlan(None, ())
        self._warmed_up: set[str] = set()  # models that have run a job since they loaded

    # -- heartbeats ----------------------------------------------------------------

    async def heartbeat(self, status: str = "ready") -> None:
        reading = self.telemetry.read()
        self.plan = await self.repo.heartbeat(
            WorkerHeartbeat(
                id=self.worker_id,
                kind="sampler",
                address=self.address,
                device=reading.name if reading.name != "cpu" else str(self.engine.device),
                models=tuple(self.engine.registry.names()),
                warm_models=tuple(self.engine.warm_models()),
                vram_total_bytes=reading.vram_total_bytes,
                vram_used_bytes=reading.vram_used_bytes,
                temperature_c=reading.temperature_c,
                status=status,
                telemetry={**reading.as_dict(), "inflight": len(self.tracker.running())},
            ),
            now=datetime.now(UTC),
        )

    async def heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.heartbeat()
            except StoreError as exc:
                log.warning("heartbeat failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_interval_s)

    # -- the dispatch loop ---------------------------------------------------------

    async def dispatch_loop(self, stop: asyncio.Event) -> None:
        sub = await self.bus.dispatch_consumer(self.worker_id)
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(1, timeout=0.5)
                except (TimeoutError, NatsTimeoutError):
                    await self.follow_plan()  # idle: the moment to load or drop models
                    continue
                for msg in msgs:
                    await self.handle(msg)
        finally:
            # A pull subscription left to drain waits on its expired fetches.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def handle(self, msg) -> None:
        dispatch = Dispatch.decode(msg.data)
        try:
            job = await self.repo.start_job(dispatch.job_id, dispatch.attempt, self.worker_id, now=datetime.now(UTC))
        except StoreError as exc:
            log.warning("cannot start %s, will be redelivered: %s", dispatch.job_id, exc)
            await msg.nak(delay=1.0)
            return
        if job is None:
            # Cancelled before it started, or a stale attempt: nothing to run.
            log.info("dropping %s attempt %d: no longer scheduled here", dispatch.job_id, dispatch.attempt)
            await msg.ack()
            return
        watch = self.tracker.open(job.id, job.attempt)
        await watch.emit(sampler_pb2.SamplerEvent(stage=sampler_pb2.SAMPLER_STAGE_RUNNING))
        keepalive = asyncio.create_task(self._keep_in_progress(msg))
        try:
            await self.run_job(job, watch)
        finally:
            keepalive.cancel()
        # Acked only now that the outcome is stored (or was not ours to store).
        await msg.ack()
        await watch.emit(sampler_pb2.SamplerEvent(finished=True))

    async def follow_plan(self) -> None:
        """Loads what the planner wants warm here and drops what it does not (a
        model is dropped only once the plan names others). Runs between jobs."""
        planned = [m for m in self.plan.models if m in self.engine.registry]
        if not planned:
            return
        warm = set(self.engine.warm_models())
        for name in warm - set(planned):
            await asyncio.to_thread(self.engine.unload, name)
            self._warmed_up.discard(name)
        for name in planned:
            if name not in warm:
                try:
                    await asyncio.to_thread(self.engine.load, name)
                except DarkroomError as exc:
                    log.warning("cannot preload %s: %s", name, exc)
                return  # one load per idle moment: a job may be waiting

    async def _learn(self, job: JobRecord, seconds: float) -> None:
        """Folds this job's duration into the learned estimates (shared by every
        scheduler replica, kept across restarts)."""
        shape = Shape(job.model, job.width * job.height, job.steps, job.num_images)
        step_s = self.engine.registry.get(job.model).step_s_512

        def learn(entry: Estimate | None, speeds: dict[str, Estimate]) -> tuple[Estimate, Estimate]:
            durations = durations_from({shape.key: entry} if entry else {}, speeds)
            obs = observe(durations, shape, step_s, self.worker_id, seconds)
            return (obs.shape.mean, obs.shape.count), (obs.speed.mean, obs.speed.count)

        try:
            await self.repo.learn(shape.key, self.worker_id, learn, now=datetime.now(UTC))
        except StoreError as exc:
            log.warning("cannot record the duration of %s: %s", job.id, exc)

    async def _keep_in_progress(self, msg) -> None:
        while True:
            await asyncio.sleep(IN_PROGRESS_EVERY_S)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def run_job(self, job: JobRecord, watch: JobWatch) -> None:
        started = time.perf_counter()
        now = lambda: datetime.now(UTC)  # noqa: E731
        # A job that had to load its model, or the first on a freshly loaded one
        # (kernels compiled, caches filled), says little about how long jobs take.
        was_warm = job.model in self._warmed_up
        try:
            latents = await self._sample(job, watch)
            if not await self.repo.set_decoding(job.id, job.attempt, now=now()):
                return
            await watch.emit(sampler_pb2.SamplerEvent(stage=sampler_pb2.SAMPLER_STAGE_DECODING))
            images = await self._decode(job, latents)
            if watch.cancelled.is_set():
                raise JobCancelled(job.id)
            stored = await self.repo.finish_job(
                job.id, job.attempt, images, now=now(), busy_s=time.perf_counter() - started
            )
            if stored:
                took = time.perf_counter() - started
                for image in images:
                    for chunk in image_chunks(image):
                        await watch.emit(sampler_pb2.SamplerEvent(output=chunk))
                if was_warm:
                    await self._learn(job, took)
                self._warmed_up.add(job.model)
            log.info("job %s done in %.2fs (stored=%s)", job.id, time.perf_counter() - started, stored)
        except JobCancelled:
            await self.repo.end_job(job.id, job.attempt, JobStatus.CANCELLED, error="cancelled", now=now())
            log.info("job %s cancelled", job.id)
        except DarkroomError as exc:
            log.warning("job %s failed: %s", job.id, exc)
            await self.repo.end_job(job.id, job.attempt, JobStatus.FAILED, error=str(exc), now=now())
        except Exception as exc:
            log.exception("job %s failed", job.id)
            await self.repo.end_job(
                job.id, job.attempt, JobStatus.FAILED, error=f"{type(exc).__name__}: {exc}", now=now()
            )

    async def _sample(self, job: JobRecord, watch: JobWatch) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        last_write = 0.0

        async def record(step: int, total: int) -> None:
            if await self.repo.set_progress(job.id, job.attempt, step, total):
                watch.cancelled.set()  # cancel_requested in the database

        def on_step(step: int, total: int) -> None:
            nonlocal last_write
            progress = sampler_pb2.SamplerProgress(step=step, total=total)
            watch.emit_threadsafe(sampler_pb2.SamplerEvent(progress=progress))
            if step == total or time.monotonic() - last_write >= PROGRESS_WRITE_EVERY_S:
                last_write = time.monotonic()
                asyncio.run_coroutine_threadsafe(record(step, total), loop)

        request = SampleRequest(
            job.model,
            job.prompt,
            job.negative_prompt,
            job.width,
            job.height,
            job.steps,
            job.guidance_scale,
            job.seed,
            job.num_images,
        )
        return await asyncio.to_thread(self.engine.sample, request, on_step, watch.cancelled)

    async def _decode(self, job: JobRecord, latents: torch.Tensor) -> list[ImageRecord]:
        request = latents_to_request(job, latents)
        deadline = time.monotonic() + VAE_WAIT_S
        while True:
            decoders = await self.repo.live_workers(
                "vae", stale_after_s=self.settings.worker_stale_after_s, now=datetime.now(UTC)
            )
            if decoders:
                break
            if time.monotonic() > deadline:
                raise DarkroomError("no VAE decoder is available")
            await asyncio.sleep(0.5)
        decoder = decoders[next(self._vae_round_robin) % len(decoders)]
        ch = self._vae_channels.get(decoder.address)
        if ch is None:
            ch = self._vae_channels[decoder.address] = channel(decoder.address)
        stub = vae_decoder_pb2_grpc.VaeDecoderStub(ch)
        parts: dict[int, list[bytes]] = {}
        meta: dict[int, vae_decoder_pb2.DecodeChunk] = {}
        try:
            async for chunk in stub.Decode(request, timeout=300):
                parts.setdefault(chunk.index, []).append(chunk.data)
                if chunk.last:
                    meta[chunk.index] = chunk
        except grpc.aio.AioRpcError as exc:
            raise DarkroomError(f"VAE decoder {decoder.id} failed: {exc.code().name} {exc.details()}") from exc
        if sorted(meta) != list(range(job.num_images)):
            raise DarkroomError(f"VAE decoder returned images {sorted(meta)} for {job.num_images} latents")
        return [
            ImageRecord(
                index=i,
                data=b"".join(parts[i]),
                mime_type=meta[i].mime_type,
                width=meta[i].width,
                height=meta[i].height,
                seed=(job.seed + i) % 2**63,
            )
            for i in range(job.num_images)
        ]

    async def close(self) -> None:
        for ch in self._vae_channels.values():
            await ch.close()


def image_chunks(image: ImageRecord) -> list[sampler_pb2.SamplerOutputChunk]:
    return [
        sampler_pb2.SamplerOutputChunk(
            index=image.index,
            offset=offset,
            data=data,
            last=last,
            mime_type=image.mime_type,
            width=image.width,
            height=image.height,
            seed=image.seed,
        )
        for offset, data, last in split(image.data)
    ]


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    await asyncio.to_thread(upgrade, settings.database_url)
    registry = ModelRegistry.load(settings.model_registry or None)
    device = pick_device(settings.device)
    engine = SamplerEngine(registry, settings.models_dir, device)
    for name in settings.preload_models:
        await asyncio.to_thread(engine.load, name)
    worker_id = settings.worker_id or default_worker_id(device)
    repo = Repository(settings.database_url, pool_size=4)
    bus = await Bus.connect(settings.nats_url, name=f"darkroom-worker-{worker_id}")
    telemetry = Telemetry((device.index or 0) if device.type == "cuda" else None)
    tracker = JobTracker()
    servicer = SamplerServicer(tracker)
    server = build_server(
        [(lambda s: sampler_pb2_grpc.add_SamplerServicer_to_server(servicer, s), "darkroom.internal.v1.Sampler")],
        settings.worker_host,
        settings.worker_port,
    )
    worker = GpuWorker(
        settings, repo, bus, engine, worker_id, f"{settings.worker_host}:{server.port}", telemetry, tracker
    )
    try:
        await server.grpc.start()
        await server.set_serving(True)
        await worker.heartbeat()
        log.info("gpu_worker %s on %s listening on %s", worker_id, device, worker.address)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(worker.heartbeat_loop(stop))
            tg.create_task(worker.dispatch_loop(stop))
        # Stopped: the dispatch loop has finished its in-flight job.
        with contextlib.suppress(StoreError):
            await repo.remove_worker(worker_id)
    finally:
        await server.grpc.stop(settings.shutdown_grace_s)
        await worker.close()
        await bus.close()
        await repo.close()


def main() -> None:
    run_service("gpu_worker", serve)
