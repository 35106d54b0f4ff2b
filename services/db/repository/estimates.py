"""Learned durations per job shape and speeds per worker, shared by every replica
and kept across restarts. Workers only record how long each job ran (on the job's
row); a scheduler replica folds those facts in, each once."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert

from services.db.models import JobRow, LearnedEstimateRow
from services.db.records import Estimate, Fold, RunTime
from services.db.repository.database import Database, try_lock
from services.db.states import JobStatus

# Held by the replica folding run times in, so that no two lose each other's update.
LEARNING_LOCK = 0x44524B4C


class Estimates:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def learned(self) -> tuple[dict[str, Estimate], dict[str, Estimate]]:
        """Every learned (shape durations, worker speeds)."""
        async with self.db.tx() as s:
            rows = (await s.execute(select(LearnedEstimateRow))).scalars()
            shapes: dict[str, Estimate] = {}
            speeds: dict[str, Estimate] = {}
            for r in rows:
                (shapes if r.kind == "shape" else speeds)[r.key] = (r.mean, r.count)
            return shapes, speeds

    async def learn_pass(self, fold: Fold, *, limit: int, now: datetime) -> int | None:
        """Folds the run times of jobs finished since the last pass into the stored
        estimates, each job once; returns how many, or None if another replica
        is learning."""
        async with self.db.tx() as s:
            if not await try_lock(s, LEARNING_LOCK):
                return None
            jobs = (
                (
                    await s.execute(
                        select(JobRow)
                        .where(JobRow.status == JobStatus.SUCCEEDED, JobRow.run_seconds.is_not(None), ~JobRow.learned)
                        .order_by(JobRow.finished_at, JobRow.id)
                        .limit(limit)
                    )
                )
                .scalars()
                .all()
            )
            if not jobs:
                return 0
            facts = [
                RunTime(
                    j.model,
                    j.width * j.height,
                    j.steps,
                    j.batch_rows or j.num_images,
                    j.worker_id or "",
                    j.run_seconds or 0.0,
                )
                for j in jobs
            ]
            shapes: dict[str, Estimate] = {}
            speeds: dict[str, Estimate] = {}
            for r in (await s.execute(select(LearnedEstimateRow))).scalars():
                (shapes if r.kind == "shape" else speeds)[r.key] = (r.mean, r.count)
            new_shapes, new_speeds = fold(dict(shapes), dict(speeds), facts)
            for kind, old, new in (("shape", shapes, new_shapes), ("speed", speeds, new_speeds)):
                for key, (mean, count) in new.items():
                    if old.get(key) == (mean, count):
                        continue
                    values = {"kind": kind, "key": key, "mean": mean, "count": count, "updated_at": now}
                    await s.execute(
                        insert(LearnedEstimateRow)
                        .values(**values)
                        .on_conflict_do_update(
                            index_elements=[LearnedEstimateRow.kind, LearnedEstimateRow.key],
                            set_={"mean": mean, "count": count, "updated_at": now},
                        )
                    )
            await s.execute(update(JobRow).where(JobRow.id.in_([j.id for j in jobs])).values(learned=True))
            return len(jobs)
