"""Learned durations per job shape and speeds per worker, shared by every replica
and kept across restarts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert

from services.db.models import LearnedEstimateRow
from services.db.records import Estimate, Learn
from services.db.repository.database import Database


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

    async def learn(self, shape_key: str, worker_id: str, learn: Learn, *, now: datetime) -> None:
        """Folds one observed duration into the stored estimates, atomically."""
        async with self.db.tx() as s:
            shape = (
                await s.execute(
                    select(LearnedEstimateRow)
                    .where(LearnedEstimateRow.kind == "shape", LearnedEstimateRow.key == shape_key)
                    .with_for_update()
                )
            ).scalar_one_or_none()
            speeds = {
                r.key: (r.mean, r.count)
                for r in (
                    await s.execute(select(LearnedEstimateRow).where(LearnedEstimateRow.kind == "speed"))
                ).scalars()
            }
            new_shape, new_speed = learn((shape.mean, shape.count) if shape else None, speeds)
            for kind, key, (mean, count) in (("shape", shape_key, new_shape), ("speed", worker_id, new_speed)):
                values = {"kind": kind, "key": key, "mean": mean, "count": count, "updated_at": now}
                stmt = insert(LearnedEstimateRow).values(**values)
                await s.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[LearnedEstimateRow.kind, LearnedEstimateRow.key],
                        set_={"mean": mean, "count": count, "updated_at": now},
                    )
                )
