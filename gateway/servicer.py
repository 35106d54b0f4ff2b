"""The public API's servicer: ``darkroom.v1.ImageGeneration``, each call's work."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from gateway import pages, spans
from gateway.adapter_rpcs import AdapterRpcs
from gateway.adapters import AdapterCatalog, AdapterResolver
from gateway.auth import Caller, Gatekeeper
from gateway.convert import STATUS, job_message, timestamp
from gateway.estimates import Estimator
from gateway.expansion import Expansion, asks_expansion
from gateway.fleet_messages import models_message
from gateway.metrics import STREAMS_OPEN, count_prompt_refused, count_submit
from gateway.moderation import Limits, Moderator
from gateway.names import check_lengths
from gateway.streams import follow
from gateway.tenant_adapters import TenantAdapters
from gateway.tenant_limits import limited, look_first, refused
from gateway.usage import fleet_stats, tenant_usage
from gateway.validation import Checked, check_submit, read_submit, under_output_policy, violates_policy
from scheduler import admission, facts
from scheduler.costs import costs_from
from scheduler.views import job_view
from services import quotas
from services.bus.events import Events, JobEvent
from services.coalesce import Coalescer
from services.config.safety import SafetySettings
from services.config.sections import GatewaySettings, KernelSettings
from services.db.records import ImageRecord, JobRecord, JobState, NewJob
from services.db.repository import Repository
from services.db.states import JobStatus, WorkerKind
from services.errors import ContentPolicyViolation, PermissionDenied, ResourceExhausted
from services.mesh.rpc import MeshIdentity
from services.models.registry import ModelRegistry
from services.models.store.objects import ObjectStore
from services.presence_view import PresenceView
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.rpc.server import Channels
from services.rpc.status import stream_errors, unary_errors
from services.safety import prompt_filter
from services.safety.verdicts import output_policy
from services.telemetry import logs
from services.telemetry.metrics import JOBS_FINISHED

log = logging.getLogger(__name__)


class ImageGenerationServicer(AdapterRpcs, image_generation_pb2_grpc.ImageGenerationServicer):
    def __init__(
        self,
        settings: GatewaySettings,
        repo: Repository,
        registry: ModelRegistry,
        events: Events,
        *,
        stale_after_s: float,
        mesh: MeshIdentity | None = None,
        anonymous: bool = True,
        safety: SafetySettings | None = None,
        expansion: Expansion | None = None,
        store: Callable[[], ObjectStore | None] = lambda: None,
        models_dir: Path | None = None,
    ) -> None:
        self.settings = settings
        models_dir = models_dir or KernelSettings().models_dir
        # The LoRA adapters a request may name (its tenant's own, the published ones:
        # the model store's, none without a store), and the tenants' own it keeps.
        self.adapters = AdapterResolver(repo.adapters, AdapterCatalog(store))
        self.tenant_adapters = TenantAdapters(settings, repo, registry, store, models_dir)
        self.expansion = expansion or Expansion(settings.expansion, models_dir)
        self.stale_after_s = stale_after_s
        self.repo = repo
        self.registry = registry
        self.events = events
        self.costs = costs_from(registry)
        self.config = settings.placement
        # ``anonymous``: whether it may be open while no tenant exists (services.open_access).
        self.gate = Gatekeeper(repo.tenants, settings.api_keys, anonymous=anonymous)
        self._channels = Channels(mesh)
        # The samplers and decoders, as their heartbeats say (followed once NATS answers).
        self.presence = PresenceView((WorkerKind.SAMPLER, WorkerKind.DECODER))
        self.estimator = Estimator(repo, self.presence, self.costs, self.config, stale_after_s=stale_after_s)
        # Concurrent submits share one INSERT, and one read of the queue ahead;
        # concurrent streams share their reads of the jobs they follow.
        self._create = Coalescer(self.repo.jobs.create_many)
        self._create_limited = Coalescer(self.repo.admission.create_within_limits)
        self._states = Coalescer(self.repo.jobs.states)
        self._results = Coalescer(self.repo.jobs.many_with_images)
        safety = safety or SafetySettings()
        self.safety = safety  # the image filter's policies, decided at submit
        words = prompt_filter.from_settings(safety)
        # None: submits' prompts go unchecked; Moderate checks texts with the list all the same.
        self.prompt_filter = words if safety.prompt_filter else None
        self.max_input_bytes = int(settings.max_input_mb * 2**20)
        self._check = functools.partial(
            check_submit, registry=registry, max_prompt_chars=settings.max_prompt_chars, placement=self.config
        )
        self.moderator = Moderator(
            words, Limits(settings.max_prompt_chars, self.max_input_bytes, safety.image_filter_threshold)
        )

    async def close(self) -> None:
        await self._channels.close()

    @unary_errors
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        caller = await self.gate.caller(context, "SubmitJob")
        now = datetime.now(UTC)
        tenant_lane = caller.terms.lane if caller.terms else None
        try:  # every field but the input image's: cheap, before any limit is looked at
            checked = self._check(request, now=now, tenant=caller.tenant, tenant_lane=tenant_lane)
        except PermissionDenied as exc:
            raise caller.refused("lane", "SubmitJob", exc) from None
        if violates_policy(request.prompt, self.prompt_filter):
            count_prompt_refused(checked.lane, caller.tenant)
            raise ContentPolicyViolation("prompt")
        self.expansion.check(request)
        new = await self._read(caller, request, checked, now)
        adapters = await self.adapters.resolve(caller.tenant, new.params.adapters, checked.spec)
        new = replace(new, params=replace(new.params, adapters=adapters))
        tenant_policy = caller.terms.output_policy if caller.terms else None
        new = under_output_policy(new, output_policy(self.safety, new.lane, tenant_policy))
        view = self.estimator.job_view(new)
        eta = await self.estimator.estimate(view, now)
        refusal = admission.admit(new.lane, eta, self.config)
        if refusal is not None:
            earlier = await self.repo.jobs.find_by_idempotency_key(caller.tenant, new.idempotency_key or "")
            if earlier is not None:  # accepted before: the same answer, never a refusal
                count_submit(new.lane, caller.tenant, "deduplicated")
                return await self._submitted(earlier, True, now)
            count_submit(new.lane, caller.tenant, "refused")
            raise ResourceExhausted(
                f"lane {refusal.lane!r} is full: the estimated wait of {refusal.wait_s:.0f}s passes its "
                f"{refusal.limit_s:.0f}s limit; retry later",
                retry_after_s=refusal.wait_s,
            )
        reserve = await self.estimator.gpu_seconds(view, now) * new.price
        new = spans.with_trace(replace(new, credits_reserved=reserve))
        new = await self._expanded(caller, request, new, now, eta)
        job, deduplicated = await self._store(caller, new, now, eta)
        spans.submitted(new, job, deduplicated, start=now)
        count_submit(new.lane, caller.tenant, "deduplicated" if deduplicated else "accepted")
        if deduplicated:
            return await self._submitted(job, True, now)
        await self.events.work()
        return await self._submitted(job, False, now, eta)

    async def _read(self, caller: Caller, request: pb.SubmitJobRequest, checked: Checked, now: datetime) -> NewJob:
        """The job, its image and mask decoded off the event loop, once its tenant's
        limits would let a job in (read-only; a resubmit of a stored job always):
        so too before its adapters are looked up, which reads the store."""
        read = functools.partial(read_submit, request, checked, max_input_bytes=self.max_input_bytes)
        if not (request.image or request.adapters):  # a mask alone is refused by check_submit
            return read()
        key = request.idempotency_key
        if limited(caller.terms) and not (key and await self.repo.jobs.find_by_idempotency_key(caller.tenant, key)):
            await look_first(self.repo.admission, caller, checked.lane, 0.0, now, None)
        return await asyncio.to_thread(read) if request.image else read()

    async def _expanded(
        self, caller: Caller, request: pb.SubmitJobRequest, new: NewJob, now: datetime, eta: admission.Estimate | None
    ) -> NewJob:
        """``new`` with its prompt expanded where the request asks for it (or its
        tenant's default does) and this gateway expands. A resubmit of a job already
        stored is not expanded again: its job is answered as it was stored. A job its
        tenant's limits refuse now is refused before it takes the one expansion
        thread; ``_store`` still decides for good (and draws on the limits) after."""
        tenant_default = bool(caller.terms and caller.terms.expand_prompts)
        if not self.expansion.enabled or not asks_expansion(request, tenant_default):
            return new
        if new.idempotency_key and await self.repo.jobs.find_by_idempotency_key(caller.tenant, new.idempotency_key):
            return new
        await look_first(self.repo.admission, caller, new.lane, new.credits_reserved, now, eta.run_s if eta else None)
        return replace(new, expanded_prompt=await self.expansion.expand(new.params.prompt, new.params.seed))

    async def _store(
        self, caller: Caller, new: NewJob, now: datetime, eta: admission.Estimate | None
    ) -> tuple[JobRecord, bool]:
        """The job stored, and whether an earlier submit made it; ResourceExhausted
        if its tenant's limits keep it out."""
        if not limited(caller.terms):
            # No credit limit: the job holds nothing (admission decides so on the tenant's row).
            return await self._create((replace(new, credits_reserved=0.0), now))
        outcome = await self._create_limited((new, now))
        if not isinstance(outcome, quotas.Refusal):
            return outcome
        count_submit(new.lane, caller.tenant, "refused")
        raise refused(outcome, eta.run_s if eta else None)

    async def _state(self, caller: Caller, method: str, job_id: str) -> JobState:
        return caller.own(method, job_id, await self._states(job_id), lambda state: state.tenant)

    async def _result(self, caller: Caller, method: str, job_id: str) -> tuple[JobRecord, list[ImageRecord]]:
        return caller.own(method, job_id, await self._results(job_id), lambda result: result[0].tenant)

    async def _submitted(
        self, job: JobRecord, deduplicated: bool, now: datetime, eta: admission.Estimate | None = None
    ) -> pb.SubmitJobResponse:
        if eta is None and job.status == JobStatus.QUEUED:
            eta = await self.estimator.estimate(job_view(facts.queued_job(job), self.config, self.costs), now)
        response = pb.SubmitJobResponse(job_id=job.id, status=STATUS[job.status], deduplicated=deduplicated)
        if eta is not None:
            start = now + timedelta(seconds=eta.wait_s)
            response.estimated_start_time.CopyFrom(timestamp(start))
            response.estimated_finish_time.CopyFrom(timestamp(start + timedelta(seconds=eta.run_s)))
        return response

    @unary_errors
    async def Moderate(self, request: pb.ModerateRequest, context: grpc.aio.ServicerContext) -> pb.ModerateResponse:
        caller = await self.gate.caller(context, "Moderate")
        self.moderator.check(request)  # a mistake costs no call of the tenant's rate, as a submit's
        if caller.terms is not None and caller.terms.rate_per_s is not None:
            refusal = await self.repo.admission.draw(caller.tenant, datetime.now(UTC))
            if refusal is not None:
                raise refused(refusal, None)
        return await self.moderator.moderate(request)

    @unary_errors
    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:
        caller = await self.gate.caller(context, "GetJob")
        check_lengths(request)
        with logs.about_job(request.job_id):  # another tenant's job is found without its images
            [found] = await self.repo.jobs.many_with_images([request.job_id], tenant=caller.tenant)
            return job_message(*caller.own("GetJob", request.job_id, found, lambda result: result[0].tenant))

    @stream_errors
    async def StreamJob(
        self, request: pb.StreamJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JobEvent]:
        caller = await self.gate.caller(context, "StreamJob")
        check_lengths(request)
        read_state = functools.partial(self._state, caller, "StreamJob")
        read_result = functools.partial(self._result, caller, "StreamJob")
        with logs.about_job(request.job_id):
            STREAMS_OPEN.inc()
            try:
                async for event in follow(request.job_id, self.events, read_state, read_result):
                    yield event
            finally:
                STREAMS_OPEN.dec()

    @unary_errors
    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.CancelJobResponse:
        caller = await self.gate.caller(context, "CancelJob")
        check_lengths(request)
        with logs.about_job(request.job_id):
            await self._state(caller, "CancelJob", request.job_id)
            return await self._cancel(caller, request.job_id)

    async def _cancel(self, caller: Caller, job_id: str) -> pb.CancelJobResponse:
        job, ended_now = await self.repo.jobs.request_cancel(job_id, tenant=caller.tenant, now=datetime.now(UTC))
        if ended_now:
            JOBS_FINISHED.labels(outcome="cancelled").inc()
            await self.events.job(JobEvent(job.id, job.attempt, job.status))
        if job.status in (JobStatus.RUNNING, JobStatus.DECODING) and job.worker_id:
            worker = await self.repo.workers.get(job.worker_id)
            if worker is not None:
                # The fast path; the worker also sees the flag in the database.
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await sampler_pb2_grpc.SamplerStub(self._channels.to(worker.address)).CancelJob(
                        sampler_pb2.SamplerCancelRequest(job_id=job.id), timeout=5
                    )
        return pb.CancelJobResponse(job_id=job.id, status=STATUS[job.status])

    @unary_errors
    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        caller = await self.gate.caller(context, "ListJobs")
        return await pages.jobs_page(self.repo, caller.tenant, request)

    @unary_errors
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        await self.gate.caller(context, "ListModels")
        workers = self.presence.live(WorkerKind.SAMPLER, stale_after_s=self.stale_after_s)
        return models_message(self.registry, workers)

    @unary_errors
    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        caller = await self.gate.caller(context, "GetStats")
        usage = await tenant_usage(self.repo, caller, datetime.now(UTC))
        if not caller.admin:
            return pb.GetStatsResponse(usage=usage)
        workers, totals, lanes = await fleet_stats(self.repo, self.presence, self.stale_after_s)
        return pb.GetStatsResponse(workers=workers, totals=totals, usage=usage, lanes=lanes)
