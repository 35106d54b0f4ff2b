"""Carrying out preemption: after a placement pass, the jobs it left waiting (or
placed behind running work) that may preempt are matched against the running jobs
by the pure rule (``scheduler.preemption``); each running job it chooses is flagged
``suspend_requested`` in the database, fenced by attempt and by the job's
preemption count, and its worker is told at once over ``Sampler.SuspendJob``. A
worker that does not hear the call sees the flag at its next progress write, so a
lost call costs a fraction of a second, not the preemption."""

from __future__ import annotations

import logging
from dataclasses import replace

import grpc

from scheduler import driver, facts
from scheduler.driver import PassDecision
from scheduler.metrics import PREEMPTIONS
from scheduler.preemption import Preemption
from scheduler.snapshot import FleetSnapshot
from services.config.placement import PlacementSettings, PreemptionSettings
from services.db.repository import Repository
from services.mesh.rpc import MeshIdentity
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc
from services.rpc.server import Channels

log = logging.getLogger(__name__)

SUSPEND_CALL_TIMEOUT_S = 2.0


class Preempter:
    def __init__(
        self,
        repo: Repository,
        placement: PlacementSettings,
        preemption: PreemptionSettings,
        mesh: MeshIdentity | None = None,
    ) -> None:
        self.repo = repo
        self.placement = placement
        self.preemption = preemption
        self._channels = Channels(mesh)

    async def after_pass(self, fleet: FleetSnapshot, decision: PassDecision) -> list[Preemption]:
        """Asks for the suspensions the rule chooses after the pass that ``fleet``
        and ``decision`` are of; returns those asked for."""
        if not self.preemption.enabled:
            return []
        waiting = driver.waiting_for_room(decision, self.preemption)
        if not waiting:
            return []
        running = tuple(map(facts.running_job, await self.repo.checkpoints.running()))
        chosen = driver.preempt(
            decision, replace(fleet, running=running), self.preemption, self.placement, waiting=waiting
        )
        asked = []
        for p in chosen:
            address = await self.repo.checkpoints.request_suspend(
                p.job_id, p.attempt, max_preemptions=self.preemption.max_preemptions, reason=_reason(p)
            )
            if address is None:
                continue  # it moved on meanwhile, or another pass asked first
            PREEMPTIONS.inc()
            log.info("suspending %s on %s: %s", p.job_id, p.worker_id, p.reason, extra={"job_id": p.job_id})
            await self._tell(address, p)
            asked.append(p)
        return asked

    async def _tell(self, address: str, p: Preemption) -> None:
        request = sampler_pb2.SamplerSuspendRequest(job_id=p.job_id, attempt=p.attempt, reason=_reason(p))
        try:
            await sampler_pb2_grpc.SamplerStub(self._channels.to(address)).SuspendJob(
                request, timeout=SUSPEND_CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            log.info("%s did not take the suspension of %s (its flag will do): %s", address, p.job_id, exc.code())

    async def close(self) -> None:
        await self._channels.close()


def _reason(p: Preemption) -> str:
    """What its suspension says, whether its worker hears the call or the flag."""
    return f"preempted for {p.for_job_id}"
