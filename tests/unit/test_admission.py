"""Wait estimate and backpressure of scheduler.admission, over plain data.

An "sd" job runs 1 s on a speed-1.0 worker; its model loads in 8 s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from scheduler.admission import Estimate, Refusal, admit, estimate
from scheduler.estimates import Durations, Learned
from scheduler.policy import Fleet, JobView, ModelCost, WorkerView
from services.config.placement import PlacementSettings
from services.db.states import WorkerStatus

GB = 1024**3
COSTS = {
    "sd": ModelCost("image", step_s_512=0.05, load_s=8.0, vram_bytes=4 * GB),
    "xl": ModelCost("image", step_s_512=0.1, load_s=12.0, vram_bytes=12 * GB),
    "big": ModelCost("image", step_s_512=0.1, load_s=20.0, vram_bytes=30 * GB),
}
FLEET = Fleet(COSTS)
CONFIG = PlacementSettings()  # paid: 120 s, free: 300 s


def job(model: str = "sd", **overrides: Any) -> JobView:
    return replace(JobView("j", model, width=512, height=512, steps=20, num_images=1), **overrides)


def worker(wid: str = "w", *, warm: tuple[str, ...] = ("sd",), **overrides: Any) -> WorkerView:
    base = WorkerView(wid, frozenset(COSTS), frozenset(warm), vram_total_bytes=24 * GB, vram_used_bytes=0)
    return replace(base, **overrides)


def wait(j: JobView, ahead: list[tuple[JobView, int]], workers: list[WorkerView], fleet: Fleet = FLEET) -> float:
    e = estimate(j, ahead, workers, fleet)
    assert e is not None
    return e.wait_s


def test_no_estimate_without_a_capable_worker() -> None:
    assert estimate(job(), [], [], FLEET) is None
    assert estimate(job(), [], [worker(state=WorkerStatus.DRAINING)], FLEET) is None
    assert estimate(job(), [], [worker(models=frozenset({"xl"}))], FLEET) is None
    assert estimate(job("big"), [], [worker()], FLEET) is None  # 30 GB on 24 GB
    assert estimate(job("nope"), [], [worker()], FLEET) is None


def test_idle_warm_worker_means_no_wait() -> None:
    e = estimate(job(), [], [worker()], FLEET)
    assert e is not None and e.wait_s == 0.0 and e.run_s == pytest.approx(1.0)


def test_wait_grows_with_queued_work_ahead() -> None:
    assert wait(job(), [(job(), 3)], [worker()]) == pytest.approx(3.0)
    assert wait(job(), [(job(), 3), (job("xl"), 1)], [worker()]) == pytest.approx(5.0)


def test_queued_work_no_capable_worker_serves_does_not_count() -> None:
    sd_only = worker(models=frozenset({"sd"}))
    assert wait(job(), [(job("xl"), 5)], [sd_only]) == pytest.approx(0.0)


def test_wait_grows_with_held_work() -> None:
    assert wait(job(), [], [worker(held_work_s=5.0)]) == pytest.approx(5.0)
    # Spread over the workers: 10 s held on one of two equal workers is 5 s.
    assert wait(job(), [], [worker("a", held_work_s=10.0), worker("b")]) == pytest.approx(5.0)


def test_wait_shrinks_with_more_workers() -> None:
    ahead = [(job(), 10)]
    assert wait(job(), ahead, [worker("a")]) == pytest.approx(10.0)
    assert wait(job(), ahead, [worker("a"), worker("b")]) == pytest.approx(5.0)


def test_wait_shrinks_with_faster_workers() -> None:
    ahead = [(job(), 10)]
    assert wait(job(), ahead, [worker(speed=2.0)]) == pytest.approx(5.0)
    learned = replace(FLEET, durations=Durations(speeds={"a": Learned(1.0, 10), "b": Learned(3.0, 10)}))
    # Learned speeds 0.5 and 1.5 (mean 1), whatever is declared: "b" alone is 1.5x, both 2x.
    assert wait(job(), ahead, [worker("b", speed=10.0)], learned) == pytest.approx(10.0 / 1.5)
    assert wait(job(), ahead, [worker("a"), worker("b")], learned) == pytest.approx(5.0)


def test_run_time_is_on_the_fastest_capable_worker() -> None:
    e = estimate(job(), [], [worker("a"), worker("b", speed=4.0)], FLEET)
    assert e is not None and e.run_s == pytest.approx(0.25)


def test_load_time_is_added_when_no_capable_worker_has_the_model_warm() -> None:
    assert wait(job(), [], [worker(warm=())]) == pytest.approx(8.0)
    assert wait(job(), [], [worker("a", warm=()), worker("b")]) == pytest.approx(0.0)
    # A warm worker that cannot take the job does not count.
    assert wait(job(), [], [worker("a", warm=()), worker("b", state=WorkerStatus.DRAINING)]) == pytest.approx(8.0)


def test_admit_refuses_past_the_lane_limit_with_the_wait_as_retry_delay() -> None:
    assert admit("paid", Estimate(121.0, 1.0), CONFIG) == Refusal("paid", 121.0, 120.0)
    assert admit("free", Estimate(301.0, 1.0), CONFIG) == Refusal("free", 301.0, 300.0)


def test_admit_accepts_within_the_lane_limit() -> None:
    assert admit("paid", Estimate(119.0, 1.0), CONFIG) is None
    assert admit("paid", Estimate(120.0, 1.0), CONFIG) is None
    assert admit("free", Estimate(200.0, 1.0), CONFIG) is None


def test_admit_accepts_unknown_lanes_and_missing_estimates() -> None:
    assert admit("vip", Estimate(10_000.0, 1.0), CONFIG) is None
    assert admit("paid", None, CONFIG) is None
