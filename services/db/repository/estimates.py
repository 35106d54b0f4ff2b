"""Learned durations per job shape and speeds per worker, shared by every replica
and kept across restarts. Workers only record how long each job ran (on the job's
row); a scheduler replica folds those facts in, each once."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.records import Estimate, RunTime
from services.db.repository.database import Area, fetch_all, try_lock

# Held by the replica folding run times in, so that no two lose each other's update.
LEARNING_LOCK = 0x44524B4C
_TO_LEARN = """
SELECT id, model, width, height, frames, steps, num_images, batch_rows, worker_id, run_seconds FROM jobs
WHERE status = 'SUCCEEDED' AND run_seconds IS NOT NULL AND NOT learned
ORDER BY finished_at, id LIMIT %s
"""
_STORE = """
INSERT INTO learned_estimates (kind, key, mean, count, updated_at)
SELECT kind, key, mean, count, %s
FROM unnest(%s::varchar[], %s::varchar[], %s::float8[], %s::bigint[]) AS c(kind, key, mean, count)
ON CONFLICT (kind, key) DO UPDATE
SET mean = excluded.mean, count = excluded.count, updated_at = excluded.updated_at
"""


class Estimates(Area):
    async def learned(self) -> tuple[dict[str, Estimate], dict[str, Estimate]]:
        """Every learned (shape durations, worker speeds)."""
        async with self.db.connection() as conn:
            return await _learned(conn)

    @contextlib.asynccontextmanager
    async def learn_pass(self, *, limit: int) -> AsyncIterator[Learning | None]:
        """A pass folding run times into the stored estimates, under the learning
        lock: yields the run times of up to ``limit`` jobs finished since the last
        pass and every stored estimate, or None if another replica is learning.
        The caller stores what it learned (``Learning.store``) before the block ends."""
        async with self.db.tx() as conn:
            if not await try_lock(conn, LEARNING_LOCK):
                yield None
                return
            jobs = await fetch_all(conn, _TO_LEARN, (limit,))
            facts = [
                RunTime(
                    j["model"],
                    j["width"] * j["height"] * j["frames"],
                    j["steps"],
                    j["batch_rows"] or j["num_images"],
                    j["worker_id"] or "",
                    j["run_seconds"] or 0.0,
                )
                for j in jobs
            ]
            shapes, speeds = await _learned(conn) if jobs else ({}, {})
            yield Learning(conn, shapes, speeds, facts, [j["id"] for j in jobs])


@dataclass(eq=False)
class Learning:
    """One learning pass: the run times to learn from, and what is stored so far."""

    _conn: AsyncConnection[DictRow]
    shapes: dict[str, Estimate]
    speeds: dict[str, Estimate]
    facts: list[RunTime]
    _job_ids: list[str]

    async def store(self, shapes: dict[str, Estimate], speeds: dict[str, Estimate], *, now: datetime) -> None:
        """Stores the estimates that changed and marks the run times learned."""
        changed = [
            (kind, key, mean, count)
            for kind, old, new in (("shape", self.shapes, shapes), ("speed", self.speeds, speeds))
            for key, (mean, count) in sorted(new.items())
            if old.get(key) != (mean, count)
        ]
        if changed:
            await self._conn.execute(
                _STORE,
                (
                    now,
                    [c[0] for c in changed],
                    [c[1] for c in changed],
                    [c[2] for c in changed],
                    [c[3] for c in changed],
                ),
            )
        await self._conn.execute("UPDATE jobs SET learned = true WHERE id = ANY(%s)", (self._job_ids,))


async def _learned(conn: AsyncConnection[DictRow]) -> tuple[dict[str, Estimate], dict[str, Estimate]]:
    shapes: dict[str, Estimate] = {}
    speeds: dict[str, Estimate] = {}
    for r in await fetch_all(conn, "SELECT kind, key, mean, count FROM learned_estimates"):
        (shapes if r["kind"] == "shape" else speeds)[r["key"]] = (r["mean"], r["count"])
    return shapes, speeds
