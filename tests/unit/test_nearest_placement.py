"""A pass scores each job only on the workers near the front (scheduler.nearness's
``nearest``), so that a thousand GPUs cost a pass what a few do. It must decide
exactly what scoring every worker decides: checked here on random fleets and
queues (loads, speeds, heat, warm models, open batches, open seats in running
batches, caps, failed attempts, latency targets), seeded, against a pass that scores every worker."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from scheduler import nearness, placement, reports, scoring
from scheduler.estimates import Durations, Learned
from scheduler.policy import Candidate, Fleet, JobView, WorkerView
from services.config.placement import Lane, PlacementSettings
from services.db.states import WorkerStatus
from services.generation import JoinKey
from services.seats import OpenSeat
from tests.unit.test_policy import COSTS, GB

SETTINGS = (
    PlacementSettings(lanes=(Lane("paid", 10, 120.0), Lane("free", 0, 300.0)), best_effort=frozenset()),
    PlacementSettings(capability_caps=(("video", 2),)),  # the default lanes, with latency targets
)


def random_worker(rng: random.Random, i: int) -> WorkerView:
    warm = frozenset(rng.sample(sorted(COSTS), rng.randint(0, 2)))
    key = JobView("k", rng.choice(["sd", "xl"]), 512, 512, 20, 1).batch_key
    return WorkerView(
        f"w{i:04d}",
        models=frozenset(rng.sample(sorted(COSTS), rng.randint(1, len(COSTS)))),
        warm_models=warm,
        vram_total_bytes=rng.choice([0, 24 * GB, 48 * GB]),
        vram_used_bytes=sum(COSTS[m].vram_bytes for m in warm),
        speed=rng.choice([0.5, 1.0, 2.0]),
        held_jobs=rng.randint(0, 3),
        # Many workers with exactly the same load: ties are where pruning could go wrong.
        held_work_s=rng.choice([0.0, 0.0, 1.0, 2.0, rng.uniform(0, 30)]),
        held_capabilities=frozenset(rng.sample(["image", "video"], rng.randint(0, 1))),
        temperature_c=rng.choice([40.0, 40.0, 85.0]),
        state=rng.choice([WorkerStatus.READY] * 6 + [WorkerStatus.DRAINING]),
        planned_models=frozenset(rng.sample(sorted(COSTS), rng.randint(0, 1))),
        open_batches=((key, rng.randint(1, 3)),) if rng.random() < 0.2 else (),
        open_seats=tuple(
            OpenSeat(JoinKey(m, 512, 512), rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 20))
            for m in sorted(warm)
            if rng.random() < 0.3
        ),
    )


def random_job(rng: random.Random, i: int, workers: list[WorkerView]) -> JobView:
    failed = frozenset(w.id for w in rng.sample(workers, 2)) if rng.random() < 0.1 else frozenset()
    return JobView(
        f"j{i:03d}",
        rng.choice(["sd", "sd", "xl", "big", "vid"]),
        512,
        512,
        20,
        rng.choice([1, 1, 2]),
        priority=rng.choice([0, 10]),
        queued_at=rng.uniform(0, 10),
        failed_on=failed,
        target_s=rng.choice([None, 10.0, 30.0]),
        lane=rng.choice(["paid", "free"]),
    )


def every_worker(
    job: JobView,
    workers: list[WorkerView],
    near: nearness.Nearness,
    refused: dict[str, Candidate],
    fleet: Fleet,
    config: PlacementSettings,
) -> tuple[Candidate, ...]:
    return tuple(refused.get(w.id) or scoring.admitted(job, w, fleet, config) for w in workers)


@pytest.mark.parametrize("seed", range(12))
def test_scoring_the_nearest_decides_as_scoring_every_worker(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    workers = [random_worker(rng, i) for i in range(rng.choice([5, 40, 200]))]
    jobs = [random_job(rng, i, workers) for i in range(40)]
    speeds = {w.id: Learned(rng.choice([0.8, 1.0, 1.5]), 3) for w in rng.sample(workers, len(workers) // 3)}
    fleet = Fleet(COSTS, Durations(speeds=speeds))
    config = SETTINGS[seed % 2]

    nearest = placement.plan(jobs, workers, fleet, config, now=10.0)
    with monkeypatch.context() as patched:
        patched.setattr(placement, "nearest", every_worker)
        everything = placement.plan(jobs, workers, fleet, config, now=10.0)

    def decided(p: placement.Placement) -> tuple[object, ...]:
        chosen = [c for c in p.candidates if c.worker_id in (p.worker_id, p.reserved_on)]
        return (p.job_id, p.worker_id, p.reserved_on, p.reason, p.waiting_for, chosen)

    assert [decided(p) for p in nearest] == [decided(p) for p in everything]
    # Somewhere, the pass scored fewer workers than there are: the point of it.
    if len(workers) >= 40:
        assert sum(len(p.candidates) for p in nearest) < sum(len(p.candidates) for p in everything)


def test_a_thousand_idle_workers_are_not_all_scored_for_each_job() -> None:
    workers = [WorkerView(f"w{i:04d}", frozenset({"sd"}), frozenset({"sd"}), 24 * GB, 4 * GB) for i in range(1000)]
    jobs = [JobView(f"j{i:02d}", "sd", 512, 512, 20, 1, queued_at=float(i)) for i in range(64)]
    config = replace(SETTINGS[0], backlog_limit=0)
    placements = placement.plan(jobs, workers, Fleet(COSTS), config, now=100.0)
    # Each job goes to an idle worker of its own, scored on the workers holding a
    # batch it could join (those given jobs before it) and the next idle one or two.
    assert len({p.worker_id for p in placements}) == 64
    assert all(len(p.candidates) <= n + 2 for n, p in enumerate(placements))
    assert sum(len(p.candidates) for p in placements) < 64 * 1000 // 10


def test_a_jobs_routing_keeps_the_chosen_worker_and_the_next_best() -> None:
    candidates = tuple(Candidate(f"w{i:04d}", i % 3 != 0, float(1000 - i), "n") for i in range(1000))
    routing = reports.routing_json(placement.Placement("j", "w0500", "chosen", candidates))
    kept = [c["worker_id"] for c in routing["candidates"]]  # type: ignore[attr-defined]
    assert kept[0] == "w0500" and len(kept) == reports.ROUTING_CANDIDATES
    assert kept[1:] == ["w0998", "w0997", "w0995", "w0994", "w0992", "w0991", "w0989"]  # eligible, soonest first


def test_a_thousand_busy_workers_each_holding_a_batch_to_join_are_not_all_scored() -> None:
    key = JobView("k", "sd", 512, 512, 20, 1).batch_key
    rng = random.Random(5)
    workers = [
        WorkerView(
            f"w{i:04d}",
            frozenset({"sd"}),
            frozenset({"sd"}),
            24 * GB,
            4 * GB,
            held_jobs=2,
            held_work_s=rng.uniform(1.0, 20.0),
            held_capabilities=frozenset({"image"}),
            open_batches=((key, 2),),
        )
        for i in range(1000)
    ]
    jobs = [JobView(f"j{i:02d}", "sd", 512, 512, 20, 1, queued_at=float(i)) for i in range(64)]
    placements = placement.plan(jobs, workers, Fleet(COSTS), SETTINGS[0], now=100.0)
    assert all(p.worker_id is not None for p in placements)
    # The front evens out as jobs join the least loaded: still a small share of 64,000.
    assert sum(len(p.candidates) for p in placements) < 64 * 1000 // 5
