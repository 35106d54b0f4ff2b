"""Recovery's pass, as procrastinate's stalled-jobs API does it: the stalled jobs
and dead workers as a snapshot (``services.db.repository.recovery``), the
recovery policy's decisions (``scheduler.recovery``), carried out, each only while
its job is still where the decision found it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scheduler import driver, facts
from scheduler.recovery import Expire, Fail, Recovery, RecoveryConfig, Requeue
from services.db.repository import Repository
from services.db.repository.recovery import RecoveryPass
from services.db.states import JobStatus


async def recover_stalled(
    repo: Repository, config: RecoveryConfig, *, stale_after_s: float, heard: Mapping[str, float] | None
) -> list[Recovery] | None:
    """One recovery pass: the stalled jobs as a snapshot, the policy's decisions,
    carried out; None if another replica holds the lock. ``heard``: presence's
    ages of the workers (None: not to be judged now)."""
    async with repo.recovery.recovery_pass(
        heard=heard,
        stale_after_s=stale_after_s,
        max_attempts=config.max_attempts,
        shortest_timeout_s=config.shortest_timeout_s,
    ) as found:
        if found is None:
            return None
        fleet = facts.fleet_snapshot(found.now, stalled=found.jobs, dead=found.dead)
        return await apply(found, driver.recover(fleet, config))


async def apply(found: RecoveryPass, actions: Sequence[Recovery]) -> list[Recovery]:
    """Carries out the recovery policy's decisions, each only while its job is
    still where the decision found it; returns those carried out."""
    by_id = {j.id: j for j in found.jobs}
    done: list[Recovery] = []
    requeues: list[Requeue] = []
    for action in actions:
        job = by_id.get(action.job_id)
        if job is None or job.attempt != action.attempt:
            continue
        if isinstance(action, Requeue):
            if job.status == action.status:
                requeues.append(action)
        elif isinstance(action, Fail):
            if job.status == action.status and await found.end(
                job.id, job.attempt, JobStatus.FAILED, action.reason, action.failure
            ):
                done.append(action)
        elif isinstance(action, Expire):
            if job.status == JobStatus.QUEUED and await found.end(
                job.id, job.attempt, JobStatus.EXPIRED, "deadline passed while queued"
            ):
                done.append(action)
    changed = await found.requeue([(a.job_id, a.attempt, a.failure) for a in requeues])
    done += [a for a in requeues if a.job_id in changed]
    return sorted(done, key=lambda a: a.job_id)
