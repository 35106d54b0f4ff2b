"""The scheduler's passes: placing queued jobs and planning warm sets, each under
its advisory lock so that replicas take turns."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from services.db.counts import SubmittedCount
from services.db.records import SUMMARY_COLUMNS, SUMMARY_FIELDS, Assignment, HeldGroup, JobSummary
from services.db.repository.database import PLANNER_LOCK, SCHEDULER_LOCK, Area, fetch_all, fetch_one, try_lock
from services.db.repository.requeue import qualified
from services.db.states import HELD, JobStatus
from services.generation import BatchKey, Prompts

_HELD = [st.value for st in HELD]
# Up to ``limit`` placeable jobs of every lane, found without reading the rest of
# the queue, and fair to tenants: a loose index scan over the (lane, tenant) pairs
# that have queued jobs, each pair's oldest from ix_jobs_queued_by_lane_tenant,
# then per lane every tenant's oldest before anyone's second (a heavy tenant's
# backlog must not hide a light tenant's job from the pass). The policy orders
# them (lanes, aging, fair shares) and takes what it can place; jobs past their
# deadline or out of attempts are left to recovery. Given ``models``, only jobs of
# those: a backlog no live sampler can take must not fill a tenant's window and hide
# the jobs behind it that one can.
_QUEUE_WINDOW = f"""
WITH RECURSIVE queues(lane, tenant) AS (
    (SELECT lane, tenant FROM jobs WHERE status = 'QUEUED' ORDER BY lane, tenant LIMIT 1)
    UNION ALL
    SELECT next.lane, next.tenant FROM queues, LATERAL (
        SELECT j.lane, j.tenant FROM jobs j
        WHERE j.status = 'QUEUED' AND (j.lane, j.tenant) > (queues.lane, queues.tenant)
        ORDER BY j.lane, j.tenant LIMIT 1
    ) next
), queue_window AS (
    SELECT q.*, row_number() OVER (PARTITION BY q.lane ORDER BY q.turn, q.created_at, q.id) AS place
    FROM queues, LATERAL (
        SELECT {SUMMARY_COLUMNS}, row_number() OVER (ORDER BY created_at, id) AS turn FROM jobs
        WHERE status = 'QUEUED' AND lane = queues.lane AND tenant = queues.tenant
          AND failures < %(max_attempts)s AND (deadline IS NULL OR deadline > %(now)s)
          AND (%(any_model)s OR model = ANY(%(models)s))
        ORDER BY created_at LIMIT %(limit)s
    ) q
)
SELECT {SUMMARY_COLUMNS} FROM queue_window WHERE place <= %(limit)s
"""
_SCHEDULE = f"""
UPDATE jobs AS j SET
    status = 'SCHEDULED', worker_id = a.worker_id, attempt = j.attempt + 1,
    scheduled_at = %(now)s, routing = a.routing, progress_step = j.checkpoint_step
FROM unnest(%(ids)s::varchar[], %(workers)s::varchar[], %(routings)s::jsonb[]) AS a(id, worker_id, routing)
WHERE j.id = a.id AND j.status = 'QUEUED'
RETURNING {qualified(SUMMARY_FIELDS, "j")},
    -- Its prompts as its sampler encodes them, sent with its dispatch; none for a
    -- job with an input image (a text encoder may see it: Qwen-Image's edits).
    CASE WHEN j.image_digest = '' THEN coalesce(nullif(j.expanded_prompt, ''), j.prompt) END AS sampled_prompt,
    j.negative_prompt AS sampled_negative_prompt
"""


_HELD_GROUPS = """
SELECT worker_id, status, model, width, height, steps, guidance_scale, frames,
       count(*) AS jobs, sum(num_images) AS images, max(num_images) AS largest,
       coalesce(max(progress_step::float8 / nullif(progress_total, 0)), 0) AS done
FROM jobs WHERE status = ANY(%(held)s) AND worker_id IS NOT NULL
GROUP BY worker_id, status, model, width, height, steps, guidance_scale, frames
"""
# A pass's lock and everything it reads, in one statement: one round trip, and a
# server that, between statements, is always waiting with its idle-in-transaction
# timeout armed (a frozen replica's lock must die with that timeout). A replica
# that loses the lock has read for nothing, which costs less than a round trip.
_PASS_READ = f"""
SELECT pg_try_advisory_xact_lock(%(lock)s) AS locked,
       (SELECT coalesce(json_agg(q), '[]') FROM ({_QUEUE_WINDOW}) q) AS queued,
       (SELECT coalesce(json_agg(g), '[]') FROM ({_HELD_GROUPS}) g) AS held
"""
# The timestamps of a job summary, which JSON carries as text.
_SUMMARY_TIMES = tuple(f.name for f in fields(JobSummary) if str(f.type).startswith("datetime"))


def _times(row: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A row read as JSON, its timestamps parsed back."""
    for name in names:
        if isinstance(row[name], str):
            row[name] = datetime.fromisoformat(row[name])
    return row


class Scheduling(Area):
    @contextlib.asynccontextmanager
    async def placement_pass(
        self, *, limit: int, max_attempts: int, now: datetime, models: Sequence[str] | None = None
    ) -> AsyncIterator[PlacementPass | None]:
        """One placement pass under the scheduler lock: yields what it reads (the
        oldest ``limit`` placeable jobs of each lane, the work samplers hold), for
        the caller to assign jobs (``PlacementPass.assign``) before the block
        ends; None if another replica holds the lock. ``models``: only jobs of
        these models are read (None: of any). The samplers themselves come from
        presence (``services.presence_view``), not from here."""
        async with self.db.tx() as conn:
            read = await fetch_one(
                conn,
                _PASS_READ,
                {
                    "lock": SCHEDULER_LOCK,
                    "limit": limit,
                    "max_attempts": max_attempts,
                    "now": now,
                    "held": _HELD,
                    "any_model": models is None,
                    "models": list(models or ()),
                },
            )
            if read is None or not read["locked"]:
                yield None
                return
            yield PlacementPass(
                conn,
                now,
                [JobSummary.of(_times(r, _SUMMARY_TIMES)) for r in read["queued"]],
                [held_group(r) for r in read["held"]],
            )

    async def scheduled_not_started(self, *, older_than: datetime) -> list[JobSummary]:
        rows = await self.db.all(
            f"SELECT {SUMMARY_COLUMNS} FROM jobs WHERE status = 'SCHEDULED' AND scheduled_at < %s", (older_than,)
        )
        return [JobSummary.of(r) for r in rows]

    async def held_groups(self) -> list[HeldGroup]:
        """The jobs workers hold (scheduled to them, running or decoding), grouped."""
        async with self.db.connection() as conn:
            return await held_groups(conn)

    async def held_per_worker(self) -> dict[str, int]:
        rows = await self.db.all(
            "SELECT worker_id, count(*) AS n FROM jobs WHERE status = ANY(%s) GROUP BY worker_id", (_HELD,)
        )
        return {row["worker_id"]: row["n"] for row in rows if row["worker_id"]}

    async def running_per_worker(self) -> dict[str, list[str]]:
        """The jobs sampling on each worker now, by worker."""
        rows = await self.db.all(
            "SELECT worker_id, id FROM jobs WHERE status = 'RUNNING' AND worker_id IS NOT NULL ORDER BY started_at"
        )
        running: dict[str, list[str]] = {}
        for row in rows:
            running.setdefault(row["worker_id"], []).append(row["id"])
        return running

    async def note_waiting(self, waiting: Mapping[str, str]) -> None:
        """Records on each still-queued job (by id) the capability it waits for:
        no live sampler serves it. Its routing says so until it is placed."""
        await self.db.run(
            """
            UPDATE jobs AS j SET routing = jsonb_build_object(
                'worker_id', NULL, 'reason', 'no live sampler serves ' || w.capability,
                'waiting_for', w.capability, 'candidates', '[]'::jsonb)
            FROM unnest(%s::varchar[], %s::varchar[]) AS w(id, capability)
            WHERE j.id = w.id AND j.status = 'QUEUED'
            """,
            (list(waiting), list(waiting.values())),
        )

    @contextlib.asynccontextmanager
    async def planning_pass(self, *, since: datetime, newer_since: datetime) -> AsyncIterator[PlanningPass | None]:
        """One planning pass under the planner lock: yields the demand since
        ``since`` (by shape and lane, split at ``newer_since``, and what is still
        queued from before it), for the caller to plan and store each sampler's
        warm set (on NATS) while it holds the lock; None if another replica is
        planning."""
        async with self.db.tx() as conn:
            if not await try_lock(conn, PLANNER_LOCK):
                yield None
                return
            yield PlanningPass(await submitted_counts(conn, since, newer_since))


@dataclass(eq=False)
class PlacementPass:
    """What a placement pass read, and its one write."""

    _conn: AsyncConnection[DictRow]
    now: datetime
    queued: list[JobSummary]
    held: list[HeldGroup]
    # Of each job ``assign`` scheduled that has no input image: its prompts as its
    # sampler encodes them, by id.
    prompts: dict[str, Prompts] = field(default_factory=dict)

    async def assign(self, assignments: Sequence[Assignment]) -> list[JobSummary]:
        """Marks the jobs SCHEDULED on their workers (attempt raised) and returns
        them in the order assigned; a job no longer QUEUED is left out."""
        if not assignments:
            return []
        placed = await fetch_all(
            self._conn,
            _SCHEDULE,
            {
                "now": self.now,
                "ids": [a.job_id for a in assignments],
                "workers": [a.worker_id for a in assignments],
                "routings": [Jsonb(a.routing) for a in assignments],
            },
        )
        order = {a.job_id: i for i, a in enumerate(assignments)}
        self.prompts.update(
            (r["id"], Prompts(r["sampled_prompt"], r["sampled_negative_prompt"]))
            for r in placed
            if r["sampled_prompt"] is not None
        )
        return sorted((JobSummary.of(r) for r in placed), key=lambda j: order[j.id])


@dataclass(frozen=True)
class PlanningPass:
    """What a warm-set planning pass read."""

    demand: list[SubmittedCount]


async def submitted_counts(
    conn: AsyncConnection[DictRow], since: datetime, newer_since: datetime
) -> list[SubmittedCount]:
    rows = await fetch_all(
        conn,
        """
        SELECT model, width, height, steps, num_images, frames, lane,
               created_at >= %(newer)s AS newer, created_at < %(since)s AS backlog, count(*) AS n
        FROM jobs WHERE created_at >= %(since)s OR status = 'QUEUED'
        GROUP BY model, width, height, steps, num_images, frames, lane, newer, backlog
        ORDER BY model, width, height, steps, num_images, frames, lane, newer, backlog
        """,
        {"since": since, "newer": newer_since},
    )
    return [
        SubmittedCount(
            r["model"],
            r["width"],
            r["height"],
            r["steps"],
            r["num_images"],
            r["lane"],
            r["newer"],
            r["n"],
            r["backlog"],
            r["frames"],
        )
        for r in rows
    ]


async def held_groups(conn: AsyncConnection[DictRow]) -> list[HeldGroup]:
    """Per worker, state and batch key, what its jobs add up to: a few rows however
    many jobs are held."""
    return [held_group(r) for r in await fetch_all(conn, _HELD_GROUPS, {"held": _HELD})]


def held_group(r: Mapping[str, Any]) -> HeldGroup:
    return HeldGroup(
        r["worker_id"],
        JobStatus(r["status"]),
        BatchKey(r["model"], r["width"], r["height"], r["steps"], r["guidance_scale"], r["frames"]),
        r["jobs"],
        int(r["images"]),
        r["largest"],
        min(1.0, r["done"]),
    )
