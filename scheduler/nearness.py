"""Which workers a pass scores for a job: only those that could still be chosen,
least loaded first, so a pass over a thousand GPUs scores the few near the front
(``scheduler.placement`` decides from the candidates)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.policy import Candidate, Fleet, JobView, WorkerView
from scheduler.scoring import admitted
from services.config.placement import PlacementSettings
from services.generation import BatchKey, JoinKey


@dataclass
class Nearness:
    """What lets a pass score only the workers near the front for each job: the
    workers' indices by held work (then id), those holding a batch open for each
    batch key, those running a batch with a seat open for each join key, and the
    fastest worker's speed. Kept up to date as the pass gives workers jobs."""

    workers: list[WorkerView]
    fastest: float
    by_load: list[int] = field(init=False)
    joinable: dict[BatchKey, set[int]] = field(init=False)
    seated: dict[JoinKey, set[int]] = field(init=False)
    _keys: list[tuple[float, str, int]] = field(init=False)

    def __post_init__(self) -> None:
        self._keys = sorted((w.held_work_s, w.id, i) for i, w in enumerate(self.workers))
        self.by_load = [i for _, _, i in self._keys]
        self.joinable = {}
        self.seated = {}
        for i, w in enumerate(self.workers):
            self._open(i, w)

    def changed(self, i: int, before: WorkerView, after: WorkerView) -> None:
        at = bisect.bisect_left(self._keys, (before.held_work_s, before.id, i))
        del self._keys[at]
        del self.by_load[at]
        at = bisect.bisect_left(self._keys, (after.held_work_s, after.id, i))
        self._keys.insert(at, (after.held_work_s, after.id, i))
        self.by_load.insert(at, i)
        for key, _ in before.open_batches:
            self.joinable.get(key, set()).discard(i)
        for seat in before.open_seats:
            self.seated.get(seat.key, set()).discard(i)
        self._open(i, after)

    def _open(self, i: int, w: WorkerView) -> None:
        for key, rows in w.open_batches:
            if rows:
                self.joinable.setdefault(key, set()).add(i)
        for seat in w.open_seats:
            if seat.free_rows > 0:
                self.seated.setdefault(seat.key, set()).add(i)


def nearest(
    job: JobView,
    workers: Sequence[WorkerView],
    near: Nearness,
    refused: Mapping[str, Candidate],
    fleet: Fleet,
    config: PlacementSettings,
) -> tuple[Candidate, ...]:
    """The candidates ``place`` decides from, scoring workers least loaded first
    (ties by id) and only those that could still be chosen. A job can finish on a
    worker no sooner than the work held there (a hot GPU only stretches it), plus,
    unless the worker holds a batch it may join, its own duration on the fastest
    worker. A worker whose bound passes the best finish found (or, while the best
    has no room, what a warm worker with room may cost instead: ``spill_within``
    times it) cannot be chosen, nor can one that would at most tie with a best
    that has room and loses the tie by id; once the held work alone passes, no
    worker further on can be. So a pass over a thousand GPUs scores the few near
    the front, not all of them. A worker running a batch with a seat open for the
    job's join key is scored first whatever it holds: the job waits for none of
    it there. Refused workers keep their candidates (free: each model's are made
    once a pass)."""
    scored: dict[int, Candidate] = {}
    best: Candidate | None = None
    joinable = near.joinable.get(job.batch_key, set())
    own_s = fleet.durations.shape_seconds(job.shape, fleet.costs[job.model].step_s_512) / near.fastest

    def beyond(bound: float, worker_id: str) -> bool:
        if best is None:
            return False
        limit = best.finish_s if best.has_room else best.finish_s * max(config.spill_within, 1.0)
        return bound > limit or (best.has_room and bound == limit and worker_id > best.worker_id)

    def score(i: int) -> None:
        nonlocal best
        c = scored[i] = admitted(job, workers[i], fleet, config)
        if c.eligible and (best is None or (c.finish_s, c.worker_id) < (best.finish_s, best.worker_id)):
            best = c

    for i in sorted(near.seated.get(job.join_key, ())):
        if workers[i].id not in refused:
            score(i)
    for i in near.by_load:
        if i in scored:
            continue
        worker = workers[i]
        if beyond(worker.held_work_s, worker.id):
            break  # and every worker after it, more loaded (or as loaded, a greater id)
        if worker.id in refused or beyond(worker.held_work_s + (0.0 if i in joinable else own_s), worker.id):
            continue
        score(i)
    return tuple(refused.get(w.id) or scored[i] for i, w in enumerate(workers) if w.id in refused or i in scored)
