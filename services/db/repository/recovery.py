"""Recovery, as procrastinate's stalled-jobs API does it: find the jobs that can no
longer finish where they are (their worker is dead, they ran past their timeout,
they waited past their deadline, they used their attempts), let the scheduler's
pure recovery policy decide, and apply its decisions, fenced by attempt, under
the scheduler lock so that one replica at a time does it."""

from __future__ import annotations

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.records import JOB_COLUMNS, DeadWorker, Expire, Fail, JobRecord, Recovery, Requeue, Review
from services.db.repository.database import SCHEDULER_LOCK, Database, fetch_all, fetch_one, try_lock
from services.db.repository.requeue import end, requeue
from services.db.repository.workers import FRESH
from services.db.states import HELD, STARTED, JobStatus, WorkerStatus

_STALLED = f"""
SELECT {JOB_COLUMNS} FROM jobs
WHERE (status = ANY(%(held)s)
       AND (worker_id = ANY(%(dead)s) OR NOT EXISTS (SELECT 1 FROM workers w WHERE w.id = jobs.worker_id)))
   OR (status = 'QUEUED' AND (deadline < now() OR failures >= %(max_attempts)s))
   OR (status = ANY(%(started)s) AND started_at < now() - make_interval(secs => %(timeout_s)s))
ORDER BY id
FOR UPDATE SKIP LOCKED
"""


class Recoveries:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def recovery_pass(
        self,
        review: Review,
        *,
        stale_after_s: float,
        judge_heartbeats: bool,
        max_attempts: int,
        shortest_timeout_s: float,
    ) -> list[Recovery] | None:
        """One recovery pass; returns what it did, or None if another replica holds
        the scheduler lock. ``judge_heartbeats`` False: heartbeats may be stale
        because the database itself was away, so only workers that said they
        stopped count as dead."""
        async with self.db.tx() as conn:
            if not await try_lock(conn, SCHEDULER_LOCK):
                return None
            dead = await _dead_workers(conn, stale_after_s, judge_heartbeats)
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
            if not rows:
                return []
            jobs = [JobRecord.of(r) for r in rows]
            holders = sorted({j.worker_id for j in jobs if j.worker_id is not None})
            known = {r["id"] for r in await fetch_all(conn, "SELECT id FROM workers WHERE id = ANY(%s)", (holders,))}
            dead += [DeadWorker(w, "unknown worker") for w in holders if w not in known]
            clock = await fetch_one(conn, "SELECT now() AS now")
            assert clock is not None
            now = clock["now"]
            by_id = {j.id: j for j in jobs}
            done: list[Recovery] = []
            requeues: list[Requeue] = []
            for action in review(jobs, dead, now):
                job = by_id.get(action.job_id)
                if job is None or job.attempt != action.attempt:
                    continue
                if isinstance(action, Requeue):
                    if job.status == action.status:
                        requeues.append(action)
                elif isinstance(action, Fail):
                    if job.status == action.status and await end(
                        conn, job.id, job.attempt, JobStatus.FAILED, action.reason, now=now, failure=action.failure
                    ):
                        done.append(action)
                elif isinstance(action, Expire):
                    if job.status == JobStatus.QUEUED and await end(
                        conn, job.id, job.attempt, JobStatus.EXPIRED, "deadline passed while queued", now=now
                    ):
                        done.append(action)
            changed = await requeue(conn, [(a.job_id, a.attempt, a.failure) for a in requeues], now=now)
            done += [a for a in requeues if a.job_id in changed]
            return sorted(done, key=lambda a: a.job_id)


async def _dead_workers(
    conn: AsyncConnection[DictRow], stale_after_s: float, judge_heartbeats: bool
) -> list[DeadWorker]:
    gone = "status = %(gone)s"
    where = f"{gone} OR NOT ({FRESH})" if judge_heartbeats else gone
    rows = await fetch_all(
        conn,
        f"SELECT id, status, extract(epoch FROM now() - last_heartbeat) AS age FROM workers WHERE {where} ORDER BY id",
        {"gone": WorkerStatus.GONE.value, "stale_after_s": stale_after_s},
    )
    return [
        DeadWorker(
            r["id"], "the worker stopped" if r["status"] == WorkerStatus.GONE else f"no heartbeat for {r['age']:.0f}s"
        )
        for r in rows
    ]
