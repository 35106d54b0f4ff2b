"""Learned durations as the database stores them, and back: the scheduler folds
the run times workers record into the stored estimates (``scheduler.estimates``
does the learning)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scheduler.estimates import Durations, Learned, Shape, learn
from scheduler.policy import ModelCost, WorkerView, speed_id
from services.db.records import Estimate, RunTime


def durations_from(shapes: Mapping[str, Estimate], speeds: Mapping[str, Estimate]) -> Durations:
    return Durations(
        shapes={k: Learned(mean, count) for k, (mean, count) in shapes.items()},
        speeds={k: Learned(mean, count) for k, (mean, count) in speeds.items()},
    )


def _speed_of(fact: RunTime, costs: Mapping[str, ModelCost], gpus: Mapping[str, int]) -> str:
    cost = costs.get(fact.model)
    if cost is None:
        return fact.worker_id
    worker = WorkerView(fact.worker_id, frozenset(), frozenset(), 0, 0, gpus=gpus.get(fact.worker_id, 1))
    return speed_id(worker, cost)[0]


def fold_run_times(
    costs: Mapping[str, ModelCost],
    shapes: Mapping[str, Estimate],
    speeds: Mapping[str, Estimate],
    facts: Sequence[RunTime],
    gpus: Mapping[str, int],
) -> tuple[dict[str, Estimate], dict[str, Estimate]]:
    """The stored estimates after learning from ``facts``; a run of a group
    (``gpus``: each group's devices) that spanned it is learned as ``speed_id`` says."""
    observations = [(Shape(f.model, f.pixels, f.steps, f.batch), _speed_of(f, costs, gpus), f.seconds) for f in facts]
    learned = learn(durations_from(shapes, speeds), observations, {m: c.step_s_512 for m, c in costs.items()})
    return (
        {k: (v.mean, v.count) for k, v in learned.shapes.items()},
        {k: (v.mean, v.count) for k, v in learned.speeds.items()},
    )
