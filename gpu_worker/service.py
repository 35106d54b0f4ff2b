"""The sampler service: one process per GPU. Pulls its jobs from its own JetStream
subject, runs the denoising loop, has the latents decoded, stores the result and
only then acks the message.

Stopping (SIGTERM) is a drain: it takes no new job, reports ``draining`` at once,
suspends the jobs it is sampling at their next step (each goes back to the queue
with its checkpoint, to resume on another GPU, so a drain takes about one step),
lets the jobs already decoding finish within the grace period (or hands them back),
hands back what it holds but has not started, deregisters and exits."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from typing import Any

import torch

from gpu_worker.decoding.decoders import Decoders
from gpu_worker.decoding.local_decode import LocalDecoder
from gpu_worker.denoising.group_mesh import form as form_group
from gpu_worker.dispatch.consumer import DispatchConsumer
from gpu_worker.engine import SamplerEngine
from gpu_worker.group.engines import GroupEngine
from gpu_worker.group.follower import follow_leader
from gpu_worker.heartbeat import SamplerLoad
from gpu_worker.jobs.job_store import JobStore
from gpu_worker.jobs.runner import JobRunner
from gpu_worker.jobs.tracker import JobTracker, StopReason
from gpu_worker.models.model_store import SamplerModelStore
from gpu_worker.models.prefetch import Prefetcher
from gpu_worker.plan_follower import follow_plan
from gpu_worker.servicer import create_server
from services.bus.credentials import NatsCredentials
from services.bus.dispatch import Bus, ConsumerSettings, check_worker_id, host_token
from services.bus.events import Events
from services.bus.presence_board import BoardOnConnection
from services.config.fields import SettingsError, name_of
from services.config.sections import KernelSettings
from services.config.workers import SamplerSettings
from services.db.repository import Repository
from services.db.states import WorkerKind, WorkerStatus
from services.mesh.nats_auth import sampler_user
from services.mesh.rpc import MeshIdentity
from services.models.compile_cache import CompileCache
from services.models.device import pick_device
from services.models.registry import ModelRegistry
from services.models.store.objects import ObjectStore
from services.models.vae import VaeDecoderEngine
from services.ops.host import Closing, GrpcServer, JetStream, Metrics, Migrations, Part, Registered, host
from services.ops.lifecycle import EXIT_UNFIT, run_service
from services.presence import Heartbeat, Presence
from services.presence_view import PresenceView, follow
from services.safety.image_filter import image_filter_of
from services.telemetry.gpu import Telemetry

log = logging.getLogger(__name__)


def default_worker_id(device: torch.device) -> str:
    """Host and GPU: the same on every start, so a restarted sampler takes back its
    own subject and durable consumer."""
    if device.type != "cuda":
        return f"{host_token()}-cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    index = device.index or 0
    physical = visible[index].strip() if index < len(visible) and visible[index].strip() else str(index)
    return f"{host_token()}-gpu{physical}"


async def _drain(
    stop: asyncio.Event, finished: asyncio.Event, presence: Presence, tracker: JobTracker, grace_s: float
) -> None:
    """Once the worker is stopping: says so at once (nothing more is placed here),
    suspends what it samples at the next step, and hands back what is still running
    (decoding) if it has not finished within the grace."""
    await stop.wait()
    if finished.is_set():
        return
    if presence.superseded.is_set():
        tracker.stop_all(StopReason.SUPERSEDED)
        return
    suspended = tracker.suspend_sampling(StopReason.SUSPENDED, "drain")
    if suspended:
        log.info("draining: suspending %d jobs at their next step", suspended)
    await presence.set_status(WorkerStatus.DRAINING)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(finished.wait(), grace_s)
        return
    log.warning("the running job did not finish in %.0fs; handing it back", grace_s)
    tracker.stop_all(StopReason.HANDED_BACK)


def fleet_compile_cache(kernel: KernelSettings, settings: SamplerSettings, worker_id: str) -> CompileCache | None:
    """The fleet's compiled artifacts, in the model store; None without one."""
    if not kernel.model_store.model_store_url:
        return None
    signing = settings.compile_signing_key
    return CompileCache(
        ObjectStore.from_settings(kernel.model_store), signing.key if signing is not None else None, worker_id
    )


def check_capabilities(settings: SamplerSettings, registry: ModelRegistry) -> None:
    """DARKROOM_CAPABILITIES names only capabilities some model has."""
    known = registry.capabilities()
    for name in settings.capabilities:
        if name not in known:
            raise SettingsError(
                f"{name_of(SamplerSettings, 'capabilities')} names {name!r}, which no model of the registry has "
                f"(known: {', '.join(sorted(known))})"
            )


async def serve(kernel: KernelSettings, settings: SamplerSettings, stop: asyncio.Event) -> int:
    registry = kernel.registry()
    device = pick_device(settings.device)
    worker_id = check_worker_id(settings.worker_id or default_worker_id(device))
    check_capabilities(settings, registry)
    options: dict[str, Any] = {
        "memory_budget_bytes": settings.memory_budget_mb * 2**20,
        "prompt_cache_bytes": settings.prompt_cache_mb * 2**20,
        "pinned": settings.preload_models,
        "capabilities": settings.capabilities,
        "shares_device": settings.decode_locally,
        "compile_cache": fleet_compile_cache(kernel, settings, worker_id),
    }
    group = None
    if settings.group.size > 1:
        group = await asyncio.to_thread(form_group, settings.group, device)
        if not group.leads:
            return await follow_leader(SamplerEngine(registry, kernel.models_dir, device, **options), group, stop)
    engine = (
        SamplerEngine(registry, kernel.models_dir, device, **options)
        if group is None
        else GroupEngine(
            registry, kernel.models_dir, device, mesh=group, stall_after_s=settings.group.stall_after_s, **options
        )
    )
    if isinstance(engine, GroupEngine):
        engine.start_watchdog()
    # Two connections: its writes are batched (a start, a decoding, a finish per batch), and a
    # fleet's samplers share the database's connections through a pooler (docs/fleet.md).
    repo = Repository(
        kernel.database_url,
        pool_size=2,
        application_name=f"darkroom-sampler-{worker_id}",
        pooled=kernel.database_pooled,
    )
    tracker = JobTracker()
    mesh = MeshIdentity.of(kernel.mesh_dir, "sampler")
    model_store = SamplerModelStore.of(kernel, mesh)  # None without a store: nothing changes
    server = create_server(settings, tracker, mesh, model_store)
    local, keep = None, None
    # A group holds a decoder of its own for its videos, split across it, whatever else decodes here.
    if settings.local_decode_fallback or settings.decode_locally or isinstance(engine, GroupEngine):
        vaes = VaeDecoderEngine.from_settings(settings.decode, registry, kernel.models_dir, device)
        local = LocalDecoder(
            vaes,
            await image_filter_of(kernel.safety, device),  # what it decodes, it checks as a decoder service does
        )
        if isinstance(engine, GroupEngine):
            vaes.share_tiles = engine.share_tiles  # a tiled video's tiles, across the group
            tile_above_pixels = settings.decode.tile_above_pixels
            keep = functools.partial(engine.decode_kept, decode=local.decode_batch, tile_above_pixels=tile_above_pixels)
    decoder_presence = PresenceView((WorkerKind.DECODER,))
    decoders = Decoders(
        decoder_presence,
        stale_after_s=kernel.worker_stale_after_s,
        local=local,
        mesh=mesh,
        locally=settings.decode_locally,
        falls_back=settings.local_decode_fallback or settings.decode_locally,
        keep=keep,
    )
    events = Events(publisher=sampler_user(worker_id))
    credentials = NatsCredentials.of(kernel.mesh_dir, "sampler", sampler_user(worker_id))
    nats = JetStream(
        kernel,
        connection_name=f"darkroom-sampler-{worker_id}",
        events=events,
        credentials=credentials,
        manages_stream=False,
    )
    address = f"{settings.host}:{server.port}"
    telemetry = Telemetry((device.index or 0) if device.type == "cuda" else None)
    store = JobStore(repo, events, worker_id, outcome_retry_s=settings.outcome_retry_s)
    runner = JobRunner(
        store,
        engine,
        decoders,
        tracker,
        unfit_after_failures=settings.unhealthy_after_failures,
        continuous_batching=settings.continuous_batching,
    )
    announced = model_store.announced if model_store is not None else None
    load = SamplerLoad(worker_id, engine, tracker, announced, open_seats=runner.open_seats)
    heartbeat = Heartbeat(WorkerKind.SAMPLER, worker_id, address, engine, telemetry, kernel.restarts, load)
    # In a sealed mesh only the scheduler may create the bucket; a sampler waits for it.
    board = BoardOnConnection(lambda: events.nc, replicas=kernel.nats_replicas, create=credentials is None)
    presence = Presence(
        repo.workers,
        board,
        worker_id,
        heartbeat,
        events,
        interval_s=kernel.heartbeat_interval_s,
        on_superseded=stop.set,
        reads_plan=True,
    )
    parts: list[Part] = [
        Metrics(kernel, "sampler"),
        Migrations(kernel),
        Closing("database", repo.close),
        Closing("decoder channels", decoders.close),
        nats,
        GrpcServer(server, grace_s=kernel.shutdown_grace_s),
        Registered(presence),
    ]
    if model_store is not None:
        parts.insert(4, Closing("peer channels", model_store.close))

    async def work() -> int:
        log.info("sampler %s on %s listening on %s", worker_id, device, address)
        watching = [asyncio.create_task(follow(decoder_presence, nats.bus.nc, board, stop))]
        prefetch = Prefetcher(registry, None)
        if model_store is not None:
            watching.append(asyncio.create_task(model_store.follow(nats.bus.nc, board, stop)))
            watching.append(asyncio.create_task(model_store.verify_periodically(stop)))
            watching.append(asyncio.create_task(model_store.watch_loaded(stop, engine.mark_stale)))
            # Before any load (the preloads among them): store models resolve through it.
            await model_store.install(nats.bus.nc.jetstream())
            prefetch = Prefetcher(registry, model_store.cache.resolve)
        try:
            return await _work(settings, kernel.shutdown_grace_s, stop, nats.bus, presence, runner, prefetch)
        finally:
            for task in watching:
                task.cancel()
            await prefetch.close()
            if isinstance(engine, GroupEngine):
                await asyncio.to_thread(engine.close)  # its followers exit with it

    return await host(parts, work, stop)


async def _work(
    settings: SamplerSettings,
    grace_s: float,
    stop: asyncio.Event,
    bus: Bus,
    presence: Presence,
    runner: JobRunner,
    prefetch: Prefetcher,
) -> int:
    """Warms up and runs jobs until stopped (a drain) or unfit; the exit code."""
    engine = runner.engine
    consumer = DispatchConsumer(
        bus,
        presence.worker_id,
        runner,
        ConsumerSettings(settings.dispatch_ack_wait_s, settings.dispatch_max_ack_pending),
        registry=engine.registry,
        on_idle=lambda: follow_plan(presence.plan, engine, on_drop=runner.forget_warm_up, prefetch=prefetch),
        batch_wait_s=settings.batch_wait_ms / 1000.0,
        max_in_hand=settings.dispatch_max_ack_pending,
        busy=engine.busy,
    )
    finished = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(presence.run(until=finished))
        tg.create_task(_drain(stop, finished, presence, runner.tracker, grace_s))
        # Registered (as starting) before loading: what an earlier run of this
        # worker held is back in the queue already, not waiting for the load.
        for name in settings.preload_models:
            took = await asyncio.to_thread(engine.warm_up, name)
            runner.warmed_up(name)
            log.info("%s warmed up with one generation in %.2fs", name, took)
        await presence.set_status(WorkerStatus.READY)
        await consumer.run(stop)
        finished.set()
        stop.set()
    if presence.superseded.is_set():
        return EXIT_UNFIT
    if runner.unfit:
        log.error("%s; reporting unhealthy", runner.failures.why_unfit())
        await presence.set_status(WorkerStatus.UNHEALTHY)
    return EXIT_UNFIT if runner.unfit else 0


def main() -> None:
    run_service("sampler", serve, SamplerSettings)
