"""Carrying out preemption: after a placement pass, the jobs it left waiting (or
placed behind running work) that may preempt are matched against the running jobs
by the pure rule (``scheduler.preemption``); each running job it chooses is flagged
``suspend_requested`` in the database, fenced by attempt and by the job's
preemption count, and its worker is told at once over ``Sampler.SuspendJob``. A
worker that does not hear the call sees the flag at its next progress write, so a
lost call costs a fraction of a second, not the preemption."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import grpc

from scheduler import policy
from scheduler.metrics import PREEMPTIONS
from scheduler.preemption import Preemption, choose_preemptions
from scheduler.views import job_view, running_views
from services.config.placement import PlacementSettings, PreemptionSettings
from services.db.records import JobSummary
from services.db.repository import Repository
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc
from services.rpc.server import Channels

log = logging.getLogger(__name__)

SUSPEND_CALL_TIMEOUT_S = 2.0


@dataclass
class PassView:
    """What a placement pass saw and decided, for the preemption that follows it."""

    placements: list[policy.Placement]
    jobs: dict[str, JobSummary]
    workers: list[policy.WorkerView]
    fleet: policy.Fleet | None = None
    config: PlacementSettings = field(default_factory=PlacementSettings)


def waiting_for_room(view: PassView, config: PreemptionSettings) -> list[tuple[policy.JobView, str, policy.Placement]]:
    """The pass's jobs of preempting lanes, in its order, as the rule takes them. A
    job the pass placed behind other work on a worker can only be helped there: its
    placement is narrowed to that worker."""
    waiting = []
    for p in view.placements:
        job = view.jobs.get(p.job_id)
        if job is None:
            continue
        costs = view.fleet.costs if view.fleet is not None else {}
        jv = job_view(job, view.config, costs)
        if not config.may_preempt(job.lane, jv.target_s):
            continue
        if p.worker_id is not None:
            p = replace(p, candidates=tuple(c for c in p.candidates if c.worker_id == p.worker_id))
        waiting.append((jv, job.lane, p))
    return waiting


class Preempter:
    def __init__(self, repo: Repository, config: PreemptionSettings) -> None:
        self.repo = repo
        self.config = config
        self._channels = Channels()

    async def after_pass(self, view: PassView, *, now: float) -> list[Preemption]:
        """Asks for the suspensions the rule chooses for this pass; returns those
        asked for."""
        if not self.config.enabled or view.fleet is None:
            return []
        waiting = waiting_for_room(view, self.config)
        if not waiting:
            return []
        running = running_views(await self.repo.checkpoints.running(), view.workers, view.fleet, view.config)
        chosen = choose_preemptions(waiting, running, self.config, now=now, workers=view.workers, fleet=view.fleet)
        asked = []
        for p in chosen:
            address = await self.repo.checkpoints.request_suspend(
                p.job_id, p.attempt, max_preemptions=self.config.max_preemptions
            )
            if address is None:
                continue  # it moved on meanwhile, or another pass asked first
            PREEMPTIONS.inc()
            log.info("suspending %s on %s: %s", p.job_id, p.worker_id, p.reason, extra={"job_id": p.job_id})
            await self._tell(address, p)
            asked.append(p)
        return asked

    async def _tell(self, address: str, p: Preemption) -> None:
        request = sampler_pb2.SamplerSuspendRequest(
            job_id=p.job_id, attempt=p.attempt, reason=f"preempted for {p.for_job_id}"
        )
        try:
            await sampler_pb2_grpc.SamplerStub(self._channels.to(address)).SuspendJob(
                request, timeout=SUSPEND_CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            log.info("%s did not take the suspension of %s (its flag will do): %s", address, p.job_id, exc.code())

    async def close(self) -> None:
        await self._channels.close()
