"""Latency classes, one test per rule, over plain data: what a job's target is,
the order a pass takes jobs in, where best-effort work may run, what urgent work
may evict, the demand forecast the warm-set plan sizes GPUs on, and when a job
with a target preempts best-effort work.

Reference numbers (as in test_policy): an "sd" job runs 1 s on a speed-1.0
worker and its model loads in 8 s; a "vid" job runs 10 s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from scheduler.forecast import Submitted, forecast
from scheduler.placement import place
from scheduler.policy import Candidate, Fleet, JobView, ModelCost, Placement, WorkerView, order_queue
from scheduler.preemption import RunningView, choose_preemptions
from scheduler.scoring import eviction_cost, off_share
from scheduler.warm_planner import GpuView, plan_warm_sets
from services.config.placement import Lane, PlacementSettings, PreemptionSettings

GB = 1024**3
COSTS = {
    "sd": ModelCost("image", step_s_512=0.05, load_s=8.0, vram_bytes=4 * GB),
    "xl": ModelCost("image", step_s_512=0.1, load_s=12.0, vram_bytes=12 * GB),
    "vid": ModelCost("video", step_s_512=0.5, load_s=30.0, vram_bytes=16 * GB),
}
PRIORITY_ONLY = PlacementSettings(lanes=(Lane("paid", 10, 120.0), Lane("free", 0, 300.0)), best_effort=frozenset())
CLASSES = PlacementSettings(
    lanes=(Lane("paid", 10, target_s=10.0), Lane("free", 0, target_s=30.0), Lane("batch", 0)),
    best_effort=frozenset({"video"}),
    capability_targets=(("upscale", 5.0),),
)


def job(jid: str = "j", model: str = "sd", **overrides: Any) -> JobView:
    return replace(JobView(jid, model, width=512, height=512, steps=20, num_images=1), **overrides)


def worker(
    wid: str = "w", *, warm: tuple[str, ...] = (), planned: tuple[str, ...] = (), **overrides: Any
) -> WorkerView:
    """A ready 24 GB worker; its used memory is what its warm models take."""
    base = WorkerView(
        wid,
        models=frozenset(COSTS),
        warm_models=frozenset(warm),
        vram_total_bytes=24 * GB,
        vram_used_bytes=sum(COSTS[m].vram_bytes for m in warm),
        planned_models=frozenset(planned),
    )
    return replace(base, **overrides)


# -- targets -----------------------------------------------------------------------


def test_a_job_s_target_is_its_lane_s_unless_its_capability_says_otherwise() -> None:
    assert CLASSES.target_s("paid", "image") == 10.0
    assert CLASSES.target_s("free", "image") == 30.0
    # A capability's own target applies when tighter than the lane's.
    assert CLASSES.target_s("free", "upscale") == 5.0
    # Best effort wins over any lane's target, and a lane without one is best effort.
    assert CLASSES.target_s("paid", "video") is None
    assert CLASSES.target_s("batch", "image") is None
    assert CLASSES.has_targets and PlacementSettings().has_targets and not PRIORITY_ONLY.has_targets


# -- queue order --------------------------------------------------------------------


def test_latency_bound_work_goes_before_best_effort_work_of_any_priority() -> None:
    jobs = [
        job("video", "vid", priority=10, queued_at=0.0),
        job("free", target_s=30.0, queued_at=50.0),
    ]
    assert [j.id for j in order_queue(jobs, CLASSES, now=60.0)] == ["free", "video"]


def test_latency_bound_work_goes_by_deadline() -> None:
    paid = job("paid", priority=10, target_s=10.0, queued_at=30.0)  # due at 40
    early_free = job("early-free", target_s=30.0, queued_at=5.0)  # due at 35
    late_free = job("late-free", target_s=30.0, queued_at=25.0)  # due at 55
    order = order_queue([late_free, paid, early_free], CLASSES, now=30.0)
    assert [j.id for j in order] == ["early-free", "paid", "late-free"]


# -- where best-effort work runs ----------------------------------------------------


def test_best_effort_work_runs_where_the_plan_puts_it() -> None:
    video = job("v", "vid")  # no target: best effort
    fleet = Fleet(COSTS, planned={"vid": 1, "sd": 1})
    busy_image_gpu = worker("img", warm=("sd",), planned=("sd",), held_jobs=1, held_work_s=1.0)
    video_gpu = worker("vid", planned=("vid",))
    assert off_share(video, busy_image_gpu, fleet, CLASSES)
    assert not off_share(video, video_gpu, fleet, CLASSES)
    placement = place(video, [busy_image_gpu, video_gpu], fleet, CLASSES)
    assert placement.worker_id == "vid"
    # Latency-bound work is not kept to a share.
    assert not off_share(job(target_s=10.0), video_gpu, fleet, CLASSES)


def test_best_effort_work_may_take_an_idle_gpu_with_room_beside_its_models() -> None:
    video = job("v", "vid")
    fleet = Fleet(COSTS, planned={"vid": 1, "sd": 1})
    idle_with_room = worker("roomy", warm=("sd",), planned=("sd",))  # 4 + 16 GB fit in 24
    idle_full = worker("full", warm=("xl", "sd"), planned=("xl",))  # 16 more would not fit beside 16
    assert not off_share(video, idle_with_room, fleet, CLASSES)
    assert off_share(video, idle_full, fleet, CLASSES)


def test_a_best_effort_model_the_plan_gives_no_gpu_may_evict_on_an_idle_one() -> None:
    # vid (16 GB) does not fit beside xl (12 GB) in 24 GB; the plan keeps xl here
    # and gives vid nothing anywhere.
    video = job("v", "vid")
    idle_xl = worker("g", warm=("xl",), planned=("xl",))
    assert not off_share(video, idle_xl, Fleet(COSTS, planned={"xl": 1}), CLASSES)
    # Not while queued work wants what it would evict, nor where vid has GPUs of its own.
    assert off_share(video, idle_xl, Fleet(COSTS, planned={"xl": 1}, wanted={"xl": 1}), CLASSES)
    assert off_share(video, idle_xl, Fleet(COSTS, planned={"xl": 1, "vid": 1}), CLASSES)


def test_without_targets_best_effort_runs_anywhere() -> None:
    video = job("v", "vid")
    busy = worker("img", warm=("sd",), planned=("sd",), held_jobs=1, held_work_s=1.0)
    assert not off_share(video, busy, Fleet(COSTS, planned={"vid": 1}), PRIORITY_ONLY)


def test_before_the_first_plan_best_effort_takes_only_idle_gpus_with_room() -> None:
    video = job("v", "vid")
    unplanned = Fleet(COSTS)
    assert off_share(video, worker("busy", warm=("sd",), held_jobs=1, held_work_s=1.0), unplanned, CLASSES)
    assert not off_share(video, worker("idle", warm=("sd",)), unplanned, CLASSES)


# -- what urgent work may evict -----------------------------------------------------


def test_urgent_work_may_evict_a_best_effort_model_queued_work_still_wants() -> None:
    gpu = worker("g", warm=("vid",), planned=("vid",), vram_total_bytes=20 * GB)
    fleet = Fleet(COSTS, wanted={"vid": 3}, warm={"vid": 1})
    urgent = place(job("u", "xl", target_s=10.0), [gpu], fleet, CLASSES)
    assert urgent.worker_id == "g"
    # Best effort has no latency to lose: no reload counted.
    assert eviction_cost("xl", gpu, fleet, CLASSES, urgent=True) == (0.0, ["vid"])
    assert eviction_cost("xl", gpu, fleet, CLASSES) == (30.0, ["vid"])
    # Work without a target may not push out what the queue needs.
    assert place(job("b", "xl"), [gpu], fleet, CLASSES).worker_id is None


# -- the forecast the plan sizes GPUs on --------------------------------------------


def test_latency_bound_demand_follows_its_trend_up_and_not_below_the_mean() -> None:
    rising = forecast([Submitted("sd", 30.0, False, True), Submitted("sd", 90.0, True, True)], 60.0)
    # Older half 1.0/s, newer 3.0/s: the newer rate plus half the change.
    assert rising.latency_bound == {"sd": pytest.approx(4.0)}
    falling = forecast([Submitted("sd", 90.0, False, True), Submitted("sd", 30.0, True, True)], 60.0)
    assert falling.latency_bound == {"sd": pytest.approx(2.0)}  # the window's mean


def test_best_effort_demand_is_the_window_s_mean() -> None:
    predicted = forecast([Submitted("vid", 0.0, False, False), Submitted("vid", 60.0, True, False)], 60.0)
    assert predicted.best_effort == {"vid": pytest.approx(1.0)}
    assert predicted.best_effort_models == {"vid"}


def test_work_queued_from_before_the_window_is_planned_to_be_worked_off() -> None:
    predicted = forecast(
        [
            Submitted("vid", 30.0, False, False),
            Submitted("vid", 30.0, True, False),
            Submitted("vid", 120.0, True, False, backlog=True),
        ],
        60.0,
    )
    # 1.0/s submitted, and 120 s of backlog over the 60 s window.
    assert predicted.best_effort == {"vid": pytest.approx(3.0)}


def test_the_plan_sizes_latency_bound_work_with_headroom() -> None:
    predicted = forecast([Submitted("sd", 30.0, False, True), Submitted("vid", 30.0, False, False)], 60.0)
    assert predicted.planning(1.5, 10.0) == {"sd": pytest.approx(0.75), "vid": pytest.approx(0.5)}
    # Best-effort work is planned on what latency-bound work leaves of the fleet.
    assert predicted.planning(1.5, 1.0) == {"sd": pytest.approx(0.75), "vid": pytest.approx(0.25)}
    # A forecast past the fleet gives up its headroom before half of what the
    # latency-bound work truly leaves (0.7 - 0.5 = 0.2: 0.1 for best effort).
    assert predicted.planning(1.5, 0.7)["vid"] == pytest.approx(0.1)
    assert predicted.planning(1.5, 0.5)["vid"] == 0.0
    # A model with work of both classes is not best effort.
    both = forecast([Submitted("sd", 1.0, False, True), Submitted("sd", 1.0, True, False)], 60.0)
    assert both.best_effort_models == frozenset()


def test_best_effort_models_are_planned_only_where_they_are_primary() -> None:
    gpus = [GpuView(f"g{i}", frozenset(COSTS), frozenset(), 24 * GB, 1.0) for i in range(2)]
    plans = plan_warm_sets({"sd": 1.0, "vid": 0.5}, gpus, COSTS, best_effort=frozenset({"vid"}))
    for ws in plans.values():
        assert ("vid" in ws.models) == (ws.primary == "vid")
    anywhere = plan_warm_sets({"sd": 1.0, "vid": 0.5}, gpus, COSTS)
    assert all("vid" in ws.models for ws in anywhere.values())


# -- preemption by targets ----------------------------------------------------------

FOR_TARGETS = PreemptionSettings(for_targets=True, target_share=1.0)
NOW = 100.0


def video_on(wid: str, *, target_s: float | None = None, preemptions: int = 0) -> RunningView:
    return RunningView(f"v-{wid}", 1, wid, "free", "video", "vid", preemptions, False, 1.0, 30.0, target_s)


def waiting(
    finish_s: float, *, queued_at: float = NOW, target_s: float | None = 10.0
) -> tuple[JobView, str, Placement]:
    urgent = job("u", queued_at=queued_at, target_s=target_s)
    placement = Placement("u", None, "waits", (Candidate("a", True, finish_s, "warm"),))
    return urgent, "free", placement


def choose(
    item: tuple[JobView, str, Placement], running: list[RunningView], config: PreemptionSettings = FOR_TARGETS
) -> list[str]:
    workers = [worker("a", warm=("sd",))]
    chosen = choose_preemptions([item], running, config, now=NOW, workers=workers, fleet=Fleet(COSTS))
    return [p.job_id for p in chosen]


def test_a_job_that_would_miss_its_target_suspends_best_effort_work() -> None:
    assert choose(waiting(31.0), [video_on("a")]) == ["v-a"]


def test_a_job_that_makes_its_target_suspends_nothing() -> None:
    # Waited 2 s, done in 7 s more: 9 s against a 10 s target.
    assert choose(waiting(7.0, queued_at=NOW - 2.0), [video_on("a")]) == []
    # The same estimate after 4 s of waiting misses it.
    assert choose(waiting(7.0, queued_at=NOW - 4.0), [video_on("a")]) == ["v-a"]


def test_would_miss_means_passing_a_share_of_the_target() -> None:
    # Done in 4 s against a 10 s target: it makes it, but not within 30 % of it.
    assert choose(waiting(4.0), [video_on("a")]) == []
    assert choose(waiting(4.0), [video_on("a")], PreemptionSettings(for_targets=True)) == ["v-a"]


def test_a_job_no_worker_can_take_now_asks_nothing() -> None:
    urgent = job("u", queued_at=NOW - 20.0, target_s=10.0)
    nowhere = Placement("u", None, "waits", (Candidate("a", False, float("inf"), "cannot serve the model"),))
    assert choose((urgent, "free", nowhere), [video_on("a")]) == []


def test_latency_bound_work_is_never_suspended_for_other_latency_bound_work() -> None:
    assert choose(waiting(31.0), [video_on("a", target_s=30.0)]) == []


def test_a_job_without_a_target_preempts_nothing_by_targets() -> None:
    assert choose(waiting(31.0, target_s=None), [video_on("a")]) == []


def test_best_effort_work_is_suspended_at_most_max_preemptions_times() -> None:
    assert choose(waiting(31.0), [video_on("a", preemptions=FOR_TARGETS.max_preemptions)]) == []
