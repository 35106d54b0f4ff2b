"""The public gRPC front door: ``darkroom.v1.ImageGeneration``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import grpc

from gateway.auth import ApiKeyInterceptor
from gateway.convert import STATUS, image_chunks, job_message, timestamp
from gateway.validation import validate_submit
from scheduler import admission, policy
from scheduler.views import costs_from, default_lane, durations_from, job_view, policy_config, worker_views
from services.db.migrate import upgrade_when_reachable
from services.db.records import JobRecord, WorkerRecord
from services.db.repository import Repository
from services.db.states import HELD, JobStatus, WorkerKind, WorkerStatus
from services.errors import ResourceExhausted
from services.lifecycle import run_service
from services.metrics import serve_metrics
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.rpc.server import Server, build_server, channel
from services.rpc.status import stream_errors, unary_errors
from services.settings import Settings

log = logging.getLogger("darkroom.gateway")

# While a job is not on a worker that can stream it, StreamJob re-reads it this often.
POLL_S = 0.05


class ImageGenerationServicer(image_generation_pb2_grpc.ImageGenerationServicer):
    def __init__(self, settings: Settings, repo: Repository, registry: ModelRegistry) -> None:
        self.settings = settings
        self.repo = repo
        self.registry = registry
        self.costs = costs_from(registry)
        self.config = policy_config(settings)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._fleet_view: tuple[policy.Fleet, list[policy.WorkerView]] | None = None
        self._fleet_read = 0.0

    def _sampler(self, address: str) -> sampler_pb2_grpc.SamplerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        return sampler_pb2_grpc.SamplerStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    @unary_errors
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        now = datetime.now(UTC)
        new = validate_submit(
            request,
            self.registry,
            max_prompt_chars=self.settings.max_prompt_chars,
            lanes={lane.name: lane.priority for lane in self.config.lanes},
            default_lane=default_lane(self.config).name,
            now=now,
        )
        if new.idempotency_key:
            earlier = await self.repo.jobs.find_by_idempotency_key(new.idempotency_key)
            if earlier is not None:  # accepted before: the same answer, never a refusal
                return await self._submitted(earlier, True, now)
        view = policy.JobView(new.id, new.model, new.width, new.height, new.steps, new.num_images, new.priority)
        eta = await self._estimate(view, now)
        refusal = admission.admit(new.lane, eta, self.config)
        if refusal is not None:
            raise ResourceExhausted(
                f"lane {refusal.lane!r} is full: the estimated wait of {refusal.wait_s:.0f}s passes its "
                f"{refusal.limit_s:.0f}s limit; retry later",
                retry_after_s=refusal.wait_s,
            )
        job, deduplicated = await self.repo.jobs.create(new, now=now)
        return await self._submitted(job, deduplicated, now, eta)

    async def _submitted(
        self, job: JobRecord, deduplicated: bool, now: datetime, eta: admission.Estimate | None = None
    ) -> pb.SubmitJobResponse:
        if eta is None and job.status == JobStatus.QUEUED:
            eta = await self._estimate(job_view(job), now)
        response = pb.SubmitJobResponse(job_id=job.id, status=STATUS[job.status], deduplicated=deduplicated)
        if eta is not None:
            start = now + timedelta(seconds=eta.wait_s)
            response.estimated_start_time.CopyFrom(timestamp(start))
            response.estimated_finish_time.CopyFrom(timestamp(start + timedelta(seconds=eta.run_s)))
        return response

    async def _fleet(self, now: datetime) -> tuple[policy.Fleet, list[policy.WorkerView]]:
        """The scheduler's view of the fleet, reread at most every estimates_refresh_s."""
        loop = asyncio.get_running_loop()
        if self._fleet_view is None or loop.time() - self._fleet_read >= self.settings.estimates_refresh_s:
            fleet = policy.Fleet(self.costs, durations_from(*await self.repo.estimates.learned()))
            workers = await self.repo.workers.live(WorkerKind.SAMPLER, stale_after_s=self.settings.worker_stale_after_s)
            self._fleet_view = (fleet, worker_views(workers, await self.repo.scheduling.held_jobs(), fleet))
            self._fleet_read = loop.time()
        return self._fleet_view

    async def _estimate(self, job: policy.JobView, now: datetime) -> admission.Estimate | None:
        """When the job would start and how long it would run, from the work held
        by the workers and the work queued ahead of it (read fresh)."""
        fleet, workers = await self._fleet(now)
        ahead = [
            (policy.JobView("", a.model, a.width, a.height, a.steps, a.num_images), a.count)
            for a in await self.repo.jobs.queued_ahead_shapes(job.priority)
        ]
        return admission.estimate(job, ahead, workers, fleet)

    @unary_errors
    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        job = await self.repo.jobs.get(request.job_id)
        images = await self.repo.jobs.images(job.id) if job.status == JobStatus.SUCCEEDED else []
        return job_message(job, images)

    @stream_errors
    async def StreamJob(
        self, request: pb.StreamJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JobEvent]:
        job = await self.repo.jobs.get(request.job_id)
        last_status: JobStatus | None = None
        last_step = -1
        attempt = job.attempt
        while True:
            if job.attempt != attempt:
                # Another attempt (a retry after a failure): its progress starts over.
                attempt, last_step = job.attempt, -1
            if job.status != last_status:
                last_status = job.status
                yield pb.JobEvent(job_id=job.id, status=STATUS[job.status])
            if job.status.terminal:
                images = await self.repo.jobs.images(job.id) if job.status == JobStatus.SUCCEEDED else []
                for image in images:
                    for event in image_chunks(job.id, image):
                        yield event
                yield pb.JobEvent(job_id=job.id, terminal=job_message(job))
                return
            if job.status in HELD and job.worker_id:
                async for event in self._follow_worker(job, last_step):
                    if event.HasField("progress"):
                        last_step = event.progress.step
                    elif event.HasField("status"):
                        status = JobStatus(pb.JobStatus.Name(event.status).removeprefix("JOB_STATUS_"))
                        if status == last_status:
                            continue  # already sent from the stored state
                        last_status = status
                    yield event
            else:
                await asyncio.sleep(POLL_S)
            job = await self.repo.jobs.get(job.id)

    async def _follow_worker(self, job: JobRecord, last_step: int) -> AsyncIterator[pb.JobEvent]:
        """Relays the worker's own stream of the job: status and per-step progress.
        Output and the terminal event come from the stored result, so that every
        client, early or late, gets them from one place."""
        worker = await self.repo.workers.get(job.worker_id or "")
        if worker is None:
            await asyncio.sleep(POLL_S)
            return
        stages = {
            sampler_pb2.SAMPLER_STAGE_RUNNING: pb.JOB_STATUS_RUNNING,
            sampler_pb2.SAMPLER_STAGE_DECODING: pb.JOB_STATUS_DECODING,
        }
        try:
            async for event in self._sampler(worker.address).WatchJob(sampler_pb2.WatchJobRequest(job_id=job.id)):
                if event.attempt != job.attempt:
                    return
                kind = event.WhichOneof("event")
                if kind == "stage":
                    yield pb.JobEvent(job_id=job.id, status=stages[event.stage])
                elif kind == "progress" and event.progress.step > last_step:
                    yield pb.JobEvent(
                        job_id=job.id, progress=pb.Progress(step=event.progress.step, total=event.progress.total)
                    )
                elif kind == "finished":
                    return
        except grpc.aio.AioRpcError as exc:
            # NOT_FOUND: the worker has not picked the job up yet (or has moved on);
            # anything else: it is gone. Either way, read the job again.
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.debug("watching %s on %s failed: %s", job.id, worker.id, exc.code())
            await asyncio.sleep(POLL_S)

    @unary_errors
    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
        job = await self.repo.jobs.request_cancel(request.job_id, now=datetime.now(UTC))
        if job.status in (JobStatus.RUNNING, JobStatus.DECODING) and job.worker_id:
            worker = await self.repo.workers.get(job.worker_id)
            if worker is not None:
                # The fast path; the worker also sees the flag in the database.
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self._sampler(worker.address).CancelJob(
                        sampler_pb2.SamplerCancelRequest(job_id=job.id), timeout=5
                    )
        return pb.CancelJobResponse(job_id=job.id, status=STATUS[job.status])

    @unary_errors
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        workers = await self.repo.workers.live(WorkerKind.SAMPLER, stale_after_s=self.settings.worker_stale_after_s)
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(
                    name=spec.name,
                    family=spec.family,
                    max_width=spec.max_width,
                    max_height=spec.max_height,
                    max_steps=spec.max_steps,
                    default_steps=spec.default_steps,
                    warm_on=[w.id for w in workers if spec.name in w.warm_models],
                )
                for spec in (self.registry.get(n) for n in self.registry.names())
            ]
        )

    @unary_errors
    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        stale_s = self.settings.worker_stale_after_s
        workers = await self.repo.workers.all(WorkerKind.SAMPLER, stale_after_s=stale_s)
        workers += await self.repo.workers.all(WorkerKind.DECODER, stale_after_s=stale_s)
        held = await self.repo.scheduling.held_per_worker()
        totals = await self.repo.jobs.totals()
        return pb.GetStatsResponse(
            workers=[worker_stats(w, held.get(w.id, 0)) for w in workers if w.status != WorkerStatus.GONE],
            totals=pb.GlobalStats(
                requests=totals.requests,
                queued=totals.queued,
                completed=totals.completed,
                failed=totals.failed,
                running=totals.running,
                cancelled=totals.cancelled,
                expired=totals.expired,
            ),
        )


def worker_stats(w: WorkerRecord, processing: int) -> pb.WorkerStats:
    average_s = w.busy_seconds / w.completed if w.completed else 0.0
    t = w.telemetry
    return pb.WorkerStats(
        worker_id=w.id,
        kind="decoder" if w.kind == WorkerKind.DECODER else "sampler",
        available=w.status == WorkerStatus.READY and w.live,
        processing=processing,
        completed=w.completed,
        average_seconds=average_s,
        estimated_load_seconds=processing * average_s,
        errors=w.errors,
        temperature_c=w.temperature_c,
        vram_used_bytes=w.vram_used_bytes,
        vram_total_bytes=w.vram_total_bytes,
        device=w.device,
        warm_models=list(w.warm_models),
        restarts=w.restarts,
        state=w.status.value if w.live or w.status == WorkerStatus.GONE else "unresponsive",
        telemetry_source=str(t.get("source", "none")),
        telemetry_note=str(t.get("unavailable", "")),
        utilization_pct=float(t.get("utilization_pct", 0.0)),
        memory_utilization_pct=float(t.get("memory_utilization_pct", 0.0)),
        power_w=float(t.get("power_w", 0.0)),
        power_limit_w=float(t.get("power_limit_w", 0.0)),
        sm_clock_mhz=int(t.get("sm_clock_mhz", 0)),
        max_sm_clock_mhz=int(t.get("max_sm_clock_mhz", 0)),
        throttle_reasons=[str(r) for r in t.get("throttle_reasons", ())],
        queued_images=int(t.get("queued_images", 0)),
    )


def create_server(
    settings: Settings, repo: Repository, registry: ModelRegistry
) -> tuple[Server, ImageGenerationServicer]:
    """The public gRPC server (not started); port 0 picks a free port."""
    servicer = ImageGenerationServicer(settings, repo, registry)
    interceptors = [ApiKeyInterceptor(settings.api_keys)] if settings.api_keys else []
    server = build_server(
        [
            (
                lambda s: image_generation_pb2_grpc.add_ImageGenerationServicer_to_server(servicer, s),
                "darkroom.v1.ImageGeneration",
            )
        ],
        settings.gateway_host,
        settings.gateway_port,
        interceptors,
    )
    return server, servicer


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    serve_metrics(settings, "gateway")
    if not await upgrade_when_reachable(settings.database_url, stop):
        return
    registry = ModelRegistry.load(settings.model_registry or None)
    repo = Repository(settings.database_url)
    server, servicer = create_server(settings, repo, registry)
    try:
        await server.grpc.start()
        await server.set_serving(True)
        log.info("gateway listening on %s:%d", settings.gateway_host, server.port)
        await stop.wait()
        await server.set_serving(False)
        await server.grpc.stop(settings.shutdown_grace_s)
    finally:
        await servicer.close()
        await repo.close()


def main() -> None:
    run_service("gateway", serve)
