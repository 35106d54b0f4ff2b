"""Learned durations as the database stores them, and back: the scheduler folds
the run times workers record into the stored estimates (``scheduler.estimates``
does the learning)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scheduler.estimates import Durations, Learned, Shape, learn
from scheduler.policy import ModelCost
from services.db.records import Estimate, RunTime


def durations_from(shapes: Mapping[str, Estimate], speeds: Mapping[str, Estimate]) -> Durations:
    return Durations(
        shapes={k: Learned(mean, count) for k, (mean, count) in shapes.items()},
        speeds={k: Learned(mean, count) for k, (mean, count) in speeds.items()},
    )


def fold_run_times(
    costs: Mapping[str, ModelCost],
    shapes: Mapping[str, Estimate],
    speeds: Mapping[str, Estimate],
    facts: Sequence[RunTime],
) -> tuple[dict[str, Estimate], dict[str, Estimate]]:
    """The stored estimates after learning from ``facts``."""
    observations = [(Shape(f.model, f.pixels, f.steps, f.batch), f.worker_id, f.seconds) for f in facts]
    learned = learn(durations_from(shapes, speeds), observations, {m: c.step_s_512 for m, c in costs.items()})
    return (
        {k: (v.mean, v.count) for k, v in learned.shapes.items()},
        {k: (v.mean, v.count) for k, v in learned.speeds.items()},
    )
