"""Recovery policy: pure decisions over a fleet snapshot's jobs that may be stuck,
with the clock passed in. The repository finds the candidates and applies the result.

- A job held by a dead worker goes back to the queue. If it had started, the
  attempt counts as failed; one only scheduled there did nothing and costs nothing.
- A job running past its model's hard timeout (plus a grace: its worker stops it
  at the timeout itself, so only a wedged worker lets it run on) fails its attempt.
- A failed attempt is retried until the job has failed ``max_attempts`` times;
  then the job is FAILED with every attempt's reason.
- A job still queued past its deadline is EXPIRED.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from scheduler.snapshot import FleetSnapshot
from services.db.records import AttemptFailure, JobRecord
from services.db.states import HELD, STARTED, JobStatus
from services.models.spec import DEFAULT_TIMEOUT_S

# How long past its timeout a running job may go before the scheduler takes it back.
TIMEOUT_GRACE_S = 30.0


@dataclass(frozen=True)
class Requeue:
    """Back to QUEUED. ``failure`` is None for a hand-back that costs no attempt;
    ``cause`` says why in a word or two (for the metrics)."""

    job_id: str
    attempt: int
    status: JobStatus
    failure: AttemptFailure | None
    cause: str = "worker lost"


@dataclass(frozen=True)
class Fail:
    job_id: str
    attempt: int
    status: JobStatus
    reason: str
    failure: AttemptFailure | None = None
    cause: str = "attempts used"


@dataclass(frozen=True)
class Expire:
    job_id: str
    attempt: int


Recovery = Requeue | Fail | Expire


@dataclass(frozen=True)
class RecoveryConfig:
    max_attempts: int = 3
    timeouts: Mapping[str, float] | None = None  # model -> hard timeout in seconds
    default_timeout_s: float = DEFAULT_TIMEOUT_S

    def timeout_s(self, model: str) -> float:
        return (self.timeouts or {}).get(model, self.default_timeout_s)

    @property
    def shortest_timeout_s(self) -> float:
        """Jobs started longer ago than this are worth reviewing."""
        return min([self.default_timeout_s, *(self.timeouts or {}).values()]) + TIMEOUT_GRACE_S


def failed_after(failures: Sequence[AttemptFailure]) -> str:
    return f"failed after {len(failures)} attempts: " + "; ".join(f.describe() for f in failures)


def _fail_attempt(job: JobRecord, failure: AttemptFailure, config: RecoveryConfig, cause: str) -> Recovery:
    if job.cancel_requested:
        # Requeueing a job whose cancel was requested ends it CANCELLED.
        return Requeue(job.id, job.attempt, job.status, None, cause)
    if job.failures + 1 >= config.max_attempts:
        return Fail(job.id, job.attempt, job.status, failed_after([*job.attempt_log, failure]), failure, cause)
    return Requeue(job.id, job.attempt, job.status, failure, cause)


def review(snapshot: FleetSnapshot, config: RecoveryConfig) -> list[Recovery]:
    """What to do with each of the snapshot's stalled jobs, given its dead workers."""
    why_dead = {d.id: d.reason for d in snapshot.dead}
    now = datetime.fromtimestamp(snapshot.now, UTC)
    actions: list[Recovery] = []
    for job in snapshot.stalled:
        if job.status == JobStatus.QUEUED:
            if job.deadline is not None and job.deadline <= now:
                actions.append(Expire(job.id, job.attempt))
            elif job.failures >= config.max_attempts:
                actions.append(Fail(job.id, job.attempt, job.status, failed_after(job.attempt_log)))
        elif job.status in HELD and (job.worker_id is None or job.worker_id in why_dead):
            worker = job.worker_id or "no worker"
            if job.status not in STARTED:
                actions.append(Requeue(job.id, job.attempt, job.status, None))
            else:
                failure = AttemptFailure(job.attempt, worker, why_dead.get(worker, "unknown worker"))
                actions.append(_fail_attempt(job, failure, config, "worker lost"))
        elif job.status in STARTED and job.started_at is not None:
            limit = config.timeout_s(job.params.model)
            if now - job.started_at >= timedelta(seconds=limit + TIMEOUT_GRACE_S):
                failure = AttemptFailure(job.attempt, job.worker_id or "", f"ran past the {limit:.0f}s timeout")
                actions.append(_fail_attempt(job, failure, config, "timed out"))
    return actions
