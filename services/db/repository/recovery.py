"""Recovery, as procrastinate's stalled-jobs API does it: find the jobs that can no
longer finish where they are (their worker is dead, they ran past their timeout,
they waited past their deadline, they used their attempts) and offer the writes
that take them back or end them, fenced by attempt, under the scheduler lock so
that one replica at a time does it. The scheduler's recovery policy decides."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.records import JOB_COLUMNS, AttemptFailure, JobRecord
from services.db.repository.database import SCHEDULER_LOCK, Area, fetch_all, fetch_one, try_lock
from services.db.repository.requeue import end, requeue
from services.db.repository.workers import FRESH
from services.db.states import HELD, STARTED, JobStatus, WorkerKind, WorkerStatus
from services.db.worker_records import DeadWorker

_STALLED = f"""
SELECT {JOB_COLUMNS} FROM jobs
WHERE (status = ANY(%(held)s)
       AND (worker_id = ANY(%(dead)s) OR NOT EXISTS (SELECT 1 FROM workers w WHERE w.id = jobs.worker_id)))
   OR (status = 'QUEUED' AND (deadline < now() OR failures >= %(max_attempts)s))
   OR (status = ANY(%(started)s) AND started_at < now() - make_interval(secs => %(timeout_s)s))
ORDER BY id
FOR UPDATE SKIP LOCKED
"""


class Recoveries(Area):
    @contextlib.asynccontextmanager
    async def recovery_pass(
        self,
        *,
        heard: Mapping[str, float] | None,
        stale_after_s: float,
        max_attempts: int,
        shortest_timeout_s: float,
    ) -> AsyncIterator[RecoveryPass | None]:
        """One recovery pass under the scheduler lock: yields the jobs that may be
        stuck (held by dead or unknown workers, queued past their deadline or out
        of attempts, started longer ago than ``shortest_timeout_s``), locked, with
        the dead workers and the database's clock, for the caller to requeue or
        end them; None if another replica holds the lock. ``heard``: how many
        seconds ago presence last heard from each sampler it knows (samplers
        alone hold jobs); a registered sampler not heard from within
        ``stale_after_s`` is dead. None: heartbeats cannot be judged now
        (presence has not watched long enough, or the database was away), so
        only samplers that said they stopped count as dead."""
        async with self.db.tx() as conn:
            if not await try_lock(conn, SCHEDULER_LOCK):
                yield None
                return
            dead = await _dead_workers(conn, heard, stale_after_s)
            rows = await fetch_all(
                conn,
                _STALLED,
                {
                    "held": [st.value for st in HELD],
                    "started": [st.value for st in STARTED],
                    "dead": [d.id for d in dead],
                    "max_attempts": max_attempts,
                    "timeout_s": shortest_timeout_s,
                },
            )
            jobs = [JobRecord.of(r) for r in rows]
            holders = sorted({j.worker_id for j in jobs if j.worker_id is not None})
            known = {r["id"] for r in await fetch_all(conn, "SELECT id FROM workers WHERE id = ANY(%s)", (holders,))}
            dead += [DeadWorker(w, "unknown worker") for w in holders if w not in known]
            clock = await fetch_one(conn, "SELECT now() AS now")
            assert clock is not None
            yield RecoveryPass(conn, jobs, dead, clock["now"])


@dataclass(eq=False)
class RecoveryPass:
    """What a recovery pass found, and its writes, each fenced by attempt."""

    _conn: AsyncConnection[DictRow]
    jobs: list[JobRecord]
    dead: list[DeadWorker]
    now: datetime

    async def requeue(self, jobs: Sequence[tuple[str, int, AttemptFailure | None]]) -> set[str]:
        """Puts (job id, attempt, failure or None) back in the queue; returns the
        ids requeued (a job whose attempt moved on is not)."""
        return set(await requeue(self._conn, jobs, now=self.now))

    async def end(
        self, job_id: str, attempt: int, status: JobStatus, reason: str, failure: AttemptFailure | None = None
    ) -> bool:
        """Ends the job in ``status`` if ``attempt`` is still its current one."""
        return await end(self._conn, job_id, attempt, status, reason, now=self.now, failure=failure)


async def _dead_workers(
    conn: AsyncConnection[DictRow], heard: Mapping[str, float] | None, stale_after_s: float
) -> list[DeadWorker]:
    fresh = sorted(w for w, age in (heard or {}).items() if age <= stale_after_s)
    # Alive: heard on NATS lately, or registered or heartbeat here lately (a worker
    # whose NATS was away falls back to telling PostgreSQL).
    rows = await fetch_all(
        conn,
        "SELECT id, status FROM workers WHERE kind = %(sampler)s AND (status = %(gone)s"
        f" OR (%(judge)s AND id <> ALL(%(fresh)s) AND NOT ({FRESH}))) ORDER BY id",
        {
            "sampler": WorkerKind.SAMPLER.value,
            "gone": WorkerStatus.GONE.value,
            "judge": heard is not None,
            "fresh": fresh,
            "stale_after_s": stale_after_s,
        },
    )
    return [DeadWorker(r["id"], _why_dead(r["status"], (heard or {}).get(r["id"]))) for r in rows]


def _why_dead(status: str, age_s: float | None) -> str:
    if status == WorkerStatus.GONE:
        return "the worker stopped"
    return "no heartbeat heard" if age_s is None else f"no heartbeat for {age_s:.0f}s"
