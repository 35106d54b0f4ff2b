"""Placement rules of scheduler.policy, one test per rule, over plain data.

Reference numbers: an "sd" job (512x512, 20 steps, 1 image) runs 1 s on a
speed-1.0 worker and its model loads in 8 s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from scheduler.estimates import Durations, Learned
from scheduler.placement import place, plan
from scheduler.policy import (
    Candidate,
    Fleet,
    JobView,
    ModelCost,
    Placement,
    WorkerView,
    job_seconds,
    order_queue,
    thermal_factor,
)
from scheduler.scoring import capped_out, eviction_cost
from services.config.placement import Lane, PlacementSettings
from services.db.states import WorkerStatus

GB = 1024**3
COSTS = {
    "sd": ModelCost("image", step_s_512=0.05, load_s=8.0, vram_bytes=4 * GB),  # 1 s per job
    "xl": ModelCost("image", step_s_512=0.1, load_s=12.0, vram_bytes=12 * GB, eviction_priority=1),
    "big": ModelCost("image", step_s_512=0.1, load_s=20.0, vram_bytes=30 * GB),
    "vid": ModelCost("video", step_s_512=0.5, load_s=30.0, vram_bytes=12 * GB),  # 10 s per job
}
# Lanes by priority alone (no latency targets), the policy's cost model on its own.
CONFIG = PlacementSettings(lanes=(Lane("paid", 10, 120.0), Lane("free", 0, 300.0)), best_effort=frozenset())
VIDEO_CAP = replace(CONFIG, capability_caps=(("video", 1),))


def job(jid: str = "j", model: str = "sd", **overrides: Any) -> JobView:
    return replace(JobView(jid, model, width=512, height=512, steps=20, num_images=1), **overrides)


def worker(
    wid: str = "w",
    *,
    models: tuple[str, ...] = tuple(COSTS),
    warm: tuple[str, ...] = (),
    planned: tuple[str, ...] = (),
    holds: tuple[str, ...] = (),
    **overrides: Any,
) -> WorkerView:
    """A ready 24 GB worker; its used memory is what its warm models take."""
    base = WorkerView(
        wid,
        models=frozenset(models),
        warm_models=frozenset(warm),
        vram_total_bytes=24 * GB,
        vram_used_bytes=sum(COSTS[m].vram_bytes for m in warm),
        planned_models=frozenset(planned),
        held_capabilities=frozenset(holds),
    )
    return replace(base, **overrides)


def fleet(**overrides: Any) -> Fleet:
    return Fleet(COSTS, **overrides)


def candidate(p: Placement, wid: str) -> Candidate:
    return next(c for c in p.candidates if c.worker_id == wid)


# 1. Earliest estimated completion.


def test_warm_worker_with_short_wait_beats_idle_cold_one() -> None:
    # warm: 3 s held + 1 s run = 4 s; cold: 8 s load + 1 s run = 9 s.
    workers = [worker("cold"), worker("warm", warm=("sd",), held_jobs=1, held_work_s=3.0)]
    assert place(job(), workers, fleet(), CONFIG).worker_id == "warm"


def test_idle_cold_worker_beats_warm_one_whose_wait_exceeds_load_plus_run() -> None:
    # warm: 30 s held + 1 s run = 31 s; cold: 9 s.
    workers = [worker("cold"), worker("warm", warm=("sd",), held_jobs=1, held_work_s=30.0)]
    assert place(job(), workers, fleet(), CONFIG).worker_id == "cold"


# 2. Duration scales with speed; learned durations win.


def test_faster_worker_wins_when_both_idle_and_warm() -> None:
    workers = [worker("fast", warm=("sd",), speed=2.0), worker("slow", warm=("sd",))]
    p = place(job(), workers, fleet(), CONFIG)
    assert p.worker_id == "fast"
    assert candidate(p, "fast").finish_s == pytest.approx(0.5)


def test_learned_shape_duration_overrides_registry_default() -> None:
    learned = Durations(shapes={job().shape.key: Learned(40.0, 10)})
    assert job_seconds(job(), worker(), fleet()) == pytest.approx(1.0)
    assert job_seconds(job(), worker(), fleet(durations=learned)) == pytest.approx(40.0)
    # Decisive: a slow warm worker beats a fast cold one for a 1 s job (1 vs 8.5 s),
    # but not for a job learned to take 40 s (40 vs 8 + 20 s).
    workers = [worker("fast-cold", speed=2.0), worker("slow-warm", warm=("sd",))]
    assert place(job(), workers, fleet(), CONFIG).worker_id == "slow-warm"
    assert place(job(), workers, fleet(durations=learned), CONFIG).worker_id == "fast-cold"


def test_learned_worker_speed_overrides_declared_speed() -> None:
    # Declared 2x faster, measured 3x slower than its peer (mean speed is 1).
    learned = Durations(speeds={"a": Learned(0.5, 10), "b": Learned(1.5, 10)})
    workers = [worker("a", warm=("sd",), speed=2.0), worker("b", warm=("sd",))]
    assert place(job(), workers, fleet(), CONFIG).worker_id == "a"
    assert place(job(), workers, fleet(durations=learned), CONFIG).worker_id == "b"


# 3. Load time and eviction cost.


def test_cold_worker_pays_the_model_load() -> None:
    p = place(job(), [worker("cold"), worker("warm", warm=("sd",))], fleet(), CONFIG)
    assert candidate(p, "cold").finish_s == pytest.approx(9.0)
    assert candidate(p, "warm").finish_s == pytest.approx(1.0)
    assert p.worker_id == "warm"  # "cold" would win the tie on its id without the load


def test_evicting_a_planned_model_costs_its_reload() -> None:
    crowded = worker("crowded", warm=("xl",), planned=("xl",), vram_used_bytes=22 * GB)
    assert eviction_cost("sd", crowded, fleet(warm={"xl": 2}), CONFIG) == (12.0, ["xl"])


def test_evicting_an_unplanned_model_with_other_warm_copies_is_free() -> None:
    crowded = worker("crowded", warm=("xl",), vram_used_bytes=22 * GB)
    assert eviction_cost("sd", crowded, fleet(warm={"xl": 2}), CONFIG) == (0.0, ["xl"])


def test_evicting_the_last_warm_copy_costs_its_reload() -> None:
    crowded = worker("crowded", warm=("xl",), vram_used_bytes=22 * GB)
    assert eviction_cost("sd", crowded, fleet(warm={"xl": 1}), CONFIG) == (12.0, ["xl"])


def test_no_eviction_when_the_model_fits_in_free_memory() -> None:
    roomy = worker("roomy", warm=("xl",), planned=("xl",))  # 12 of 24 GB used
    assert eviction_cost("sd", roomy, fleet(), CONFIG) == (0.0, [])


def test_unplanned_models_are_evicted_before_planned_ones_then_by_eviction_priority() -> None:
    # 16 of 24 GB used; "vid" needs 12 GB: one of sd (4 GB) or xl (12 GB) must go.
    both = worker("w", warm=("sd", "xl"))
    many = fleet(warm={"sd": 2, "xl": 2})
    assert eviction_cost("vid", both, many, CONFIG)[1] == ["sd"]  # lower eviction priority
    assert eviction_cost("vid", replace(both, planned_models=frozenset({"sd"})), many, CONFIG)[1] == ["xl"]


def test_eviction_of_a_planned_model_kept_off_the_worker_by_a_cap_is_free() -> None:
    crowded = worker("crowded", warm=("vid",), planned=("vid",), vram_used_bytes=22 * GB)
    capped = fleet(busy={"video": 1}, waiting={"image": 1}, warm={"vid": 2})
    assert eviction_cost("sd", crowded, capped, VIDEO_CAP)[0] == 0.0
    assert eviction_cost("sd", crowded, capped, CONFIG)[0] == 30.0


def test_reload_of_a_planned_victim_decides_placement() -> None:
    # crowded: 8 s load + 1 s run (+ 12 s reload of xl if planned); busy: 15 + 1 s.
    busy = worker("busy", warm=("sd",), held_jobs=1, held_work_s=15.0)
    unplanned = worker("crowded", warm=("xl",), vram_used_bytes=22 * GB)
    planned = replace(unplanned, planned_models=frozenset({"xl"}))
    two_copies = fleet(warm={"xl": 2})
    assert place(job(), [unplanned, busy], two_copies, CONFIG).worker_id == "crowded"
    p = place(job(), [planned, busy], two_copies, CONFIG)
    assert p.worker_id == "busy"
    assert candidate(p, "crowded").finish_s == pytest.approx(21.0)


# 4. Hot GPUs.


def test_thermal_factor_grows_linearly_above_hot_c() -> None:
    assert thermal_factor(20.0, CONFIG) == 1.0
    assert thermal_factor(70.0, CONFIG) == 1.0
    assert thermal_factor(75.0, CONFIG) == pytest.approx(1.5)
    assert thermal_factor(80.0, CONFIG) == pytest.approx(2.0)  # the seed's 2x at 80 C


def test_hot_busy_gpu_loses_to_a_cool_one_it_would_otherwise_beat() -> None:
    # cool: 5 + 1 = 6 s; hot: 3 + 1 = 4 s when cool, 3 * 2 + 1 = 7 s at 80 C.
    cool = worker("cool", warm=("sd",), held_jobs=1, held_work_s=5.0, temperature_c=40.0)
    hot = worker("hot", warm=("sd",), held_jobs=1, held_work_s=3.0, temperature_c=40.0)
    assert place(job(), [cool, hot], fleet(), CONFIG).worker_id == "hot"
    p = place(job(), [cool, replace(hot, temperature_c=80.0)], fleet(), CONFIG)
    assert p.worker_id == "cool"
    assert candidate(p, "hot").finish_s == pytest.approx(7.0)


# 5. Ineligible workers.


@pytest.mark.parametrize("state", [WorkerStatus.DRAINING, WorkerStatus.UNHEALTHY])
def test_worker_not_ready_is_ineligible(state: WorkerStatus) -> None:
    idle = worker("idle", warm=("sd",), state=state)
    busy = worker("busy", warm=("sd",), held_jobs=1, held_work_s=50.0)
    p = place(job(), [idle, busy], fleet(), CONFIG)
    assert p.worker_id == "busy"
    assert not candidate(p, "idle").eligible and candidate(p, "idle").note == state


def test_worker_that_cannot_serve_the_model_is_ineligible() -> None:
    idle = worker("idle", models=("xl",))
    busy = worker("busy", warm=("sd",), held_jobs=1, held_work_s=50.0)
    p = place(job(), [idle, busy], fleet(), CONFIG)
    assert p.worker_id == "busy"
    assert not candidate(p, "idle").eligible
    p = place(job(), [idle], fleet(), CONFIG)
    assert p.worker_id is None and "no live worker serves" in p.reason


def test_model_larger_than_total_vram_is_ineligible() -> None:
    small = worker("small")  # 24 GB; "big" needs 30
    large = worker("large", vram_total_bytes=80 * GB, held_jobs=1, held_work_s=50.0)
    p = place(job(model="big"), [small, large], fleet(), CONFIG)
    assert p.worker_id == "large"
    assert not candidate(p, "small").eligible and "fit" in candidate(p, "small").note


def test_unknown_vram_is_treated_as_unlimited() -> None:
    cpu = worker("cpu", vram_total_bytes=0, vram_used_bytes=0)
    assert place(job(model="big"), [cpu], fleet(), CONFIG).worker_id == "cpu"


def test_unknown_model_is_not_placed() -> None:
    p = place(job(model="nope"), [worker()], fleet(), CONFIG)
    assert p.worker_id is None and p.candidates == ()


# 6. Late binding.


def test_worker_over_backlog_limit_has_no_room() -> None:
    full = worker(warm=("sd",), held_jobs=3, held_work_s=3.0)
    assert not candidate(place(job(), [full], fleet(), CONFIG), "w").has_room
    assert candidate(place(job(), [replace(full, held_jobs=2)], fleet(), CONFIG), "w").has_room


def test_full_best_worker_reserves_the_job_instead_of_placing_it_elsewhere() -> None:
    # full: 3 + 1 = 4 s, sooner than the idle cold one's 9 s, but its backlog is full.
    full = worker("full", warm=("sd",), held_jobs=3, held_work_s=3.0)
    p = place(job(), [worker("cold"), full], fleet(), CONFIG)
    assert p.worker_id is None
    assert p.reserved_on == "full"
    assert "waits for full" in p.reason


def test_a_warm_worker_with_room_takes_the_job_unless_the_reservation_is_much_sooner() -> None:
    # full: 3 + 1 = 4 s; slow (speed 0.15, warm, idle): 6.7 s, within 2.5x of the
    # reservation: the job starts now on the slow worker.
    full = worker("full", warm=("sd",), held_jobs=3, held_work_s=3.0)
    slow = worker("slow", warm=("sd",), speed=0.15)
    assert place(job(), [slow, full], fleet(), CONFIG).worker_id == "slow"
    # At speed 0.09 (11.1 s, past 10 s) it waits for full.
    slower = worker("slower", warm=("sd",), speed=0.09)
    p = place(job(), [slower, full], fleet(), CONFIG)
    assert (p.worker_id, p.reserved_on) == (None, "full")
    assert place(job(), [slower, full], fleet(), replace(CONFIG, spill_within=5.0)).worker_id == "slower"


def test_plan_lets_later_jobs_see_reserved_work() -> None:
    # j1 reserves "full" (7.5 + 1 = 8.5 s < 9 s cold); with that reservation "full"
    # ends at 9.5 s, so j2 goes to the cold worker.
    full = worker("full", warm=("sd",), held_jobs=3, held_work_s=7.5)
    jobs = [job("j1", queued_at=0.0), job("j2", queued_at=1.0)]
    placements = plan(jobs, [worker("cold"), full], fleet(), CONFIG, now=10.0)
    assert [(p.job_id, p.worker_id, p.reserved_on) for p in placements] == [
        ("j1", None, "full"),
        ("j2", "cold", None),
    ]


def test_plan_counts_placed_jobs_against_the_backlog() -> None:
    # Room for one more job (held 2 <= limit 2); the next one reserves.
    w = worker("w", warm=("sd",), held_jobs=2, held_work_s=1.0)
    jobs = [job("j1", queued_at=0.0), job("j2", queued_at=1.0)]
    placements = plan(jobs, [w], fleet(), CONFIG, now=10.0)
    assert [(p.worker_id, p.reserved_on) for p in placements] == [("w", None), (None, "w")]


# 7. Anti-thrash.


def test_cold_placement_may_not_evict_a_planned_model_other_queued_jobs_want() -> None:
    # crowded: 8 + 1 + 12 (reload of xl) = 21 s beats busy's 31 s, unless queued
    # jobs want the xl it would evict.
    crowded = worker("crowded", warm=("xl",), planned=("xl",), vram_used_bytes=22 * GB)
    busy = worker("busy", warm=("sd",), held_jobs=1, held_work_s=30.0)
    assert place(job(), [crowded, busy], fleet(), CONFIG).worker_id == "crowded"
    p = place(job(), [crowded, busy], fleet(wanted={"xl": 1}), CONFIG)
    assert p.worker_id == "busy"
    assert not candidate(p, "crowded").eligible and "would evict xl" in candidate(p, "crowded").note


def test_cold_placement_may_evict_a_wanted_model_warm_on_enough_other_workers() -> None:
    crowded = worker("crowded", warm=("xl",), planned=("xl",), vram_used_bytes=22 * GB)
    busy = worker("busy", warm=("sd",), held_jobs=1, held_work_s=30.0)
    # Two queued xl jobs and xl warm here and on two more workers: one copy may go.
    assert place(job(), [crowded, busy], fleet(wanted={"xl": 2}, warm={"xl": 3}), CONFIG).worker_id == "crowded"
    # Warm here and on one more only: each copy is wanted.
    assert place(job(), [crowded, busy], fleet(wanted={"xl": 2}, warm={"xl": 2}), CONFIG).worker_id == "busy"


def test_plan_counts_later_queued_jobs_as_wanting_the_model() -> None:
    crowded = worker("crowded", warm=("xl",), planned=("xl",), vram_used_bytes=22 * GB)
    busy = worker("busy", warm=("sd",), held_jobs=1, held_work_s=30.0)
    jobs = [job("sd-job", queued_at=0.0), job("xl-job", model="xl", queued_at=1.0)]
    placements = plan(jobs, [crowded, busy], fleet(), CONFIG, now=10.0)
    assert [p.worker_id for p in placements] == ["busy", "crowded"]


# 8. Per-capability cap.


def test_capped_out_only_while_other_work_is_queued_or_running() -> None:
    other = worker("other")
    busy_video = {"video": 1}
    assert capped_out("video", other, fleet(busy=busy_video, waiting={"image": 1}), VIDEO_CAP) == 1
    assert capped_out("video", other, fleet(busy={**busy_video, "image": 1}), VIDEO_CAP) == 1
    assert capped_out("video", other, fleet(busy=busy_video, waiting={"video": 3}), VIDEO_CAP) is None
    assert capped_out("video", other, fleet(waiting={"image": 1}), VIDEO_CAP) is None  # cap not reached
    holder = worker("holder", holds=("video",))
    assert capped_out("video", holder, fleet(busy=busy_video, waiting={"image": 1}), VIDEO_CAP) is None
    assert capped_out("video", other, fleet(busy=busy_video, waiting={"image": 1}), CONFIG) is None


def test_second_gpu_may_not_take_video_while_image_work_waits() -> None:
    idle = worker("idle", warm=("vid",))
    p = place(job(model="vid"), [idle], fleet(busy={"video": 1}, waiting={"image": 1}), VIDEO_CAP)
    assert p.worker_id is None
    assert "video cap of 1" in candidate(p, "idle").note
    assert place(job(model="vid"), [idle], fleet(busy={"video": 1}), VIDEO_CAP).worker_id == "idle"


def test_plan_keeps_a_burst_of_video_on_one_gpu_while_images_wait() -> None:
    workers = [worker("a", warm=("vid",)), worker("b", warm=("vid", "sd"))]
    videos = [job("v1", model="vid", queued_at=0.0), job("v2", model="vid", queued_at=1.0)]
    image = job("i1", queued_at=2.0)
    placements = plan([*videos, image], workers, fleet(), VIDEO_CAP, now=10.0)
    assert [p.worker_id for p in placements] == ["a", "a", "b"]
    # With no other work at all, video spreads.
    assert [p.worker_id for p in plan(videos, workers, fleet(), VIDEO_CAP, now=10.0)] == ["a", "b"]


def test_capped_model_only_goes_to_workers_planned_for_it() -> None:
    planned = worker("planned", warm=("vid",), planned=("vid",), held_jobs=1, held_work_s=30.0)
    idle = worker("idle", warm=("vid",))
    p = place(job(model="vid"), [planned, idle], fleet(planned={"vid": 1}), VIDEO_CAP)
    assert p.worker_id == "planned"
    assert "not planned for vid" in candidate(p, "idle").note
    # Nobody plans it: anyone may take it.
    assert place(job(model="vid"), [planned, idle], fleet(), VIDEO_CAP).worker_id == "idle"
    # Uncapped: the plan does not restrict it.
    assert place(job(model="vid"), [planned, idle], fleet(planned={"vid": 1}), CONFIG).worker_id == "idle"


def test_plan_counts_only_live_workers_as_planned() -> None:
    draining = worker("draining", warm=("vid",), planned=("vid",), state=WorkerStatus.DRAINING)
    idle = worker("idle", warm=("vid",))
    placements = plan([job(model="vid")], [draining, idle], fleet(), VIDEO_CAP, now=0.0)
    assert placements[0].worker_id == "idle"


# 9. Lanes and aging.


def priority(lane_name: str) -> int:
    lane = CONFIG.lane(lane_name)
    assert lane is not None
    return lane.priority


def test_higher_lane_goes_first() -> None:
    jobs = [job("a-free", priority=priority("free")), job("b-paid", priority=priority("paid"))]
    assert [j.id for j in order_queue(jobs, CONFIG, now=0.0)] == ["b-paid", "a-free"]


def test_aging_lets_a_long_waiting_free_job_overtake_a_fresh_paid_one() -> None:
    # At 0.5/s, 25 s of waiting is worth 12.5 > the paid lane's 10.
    jobs = [
        job("paid", priority=priority("paid"), queued_at=25.0),
        job("free", priority=priority("free"), queued_at=0.0),
    ]
    assert [j.id for j in order_queue(jobs, CONFIG, now=25.0)] == ["free", "paid"]
    no_aging = replace(CONFIG, aging_per_s=0.0)
    assert [j.id for j in order_queue(jobs, no_aging, now=25.0)] == ["paid", "free"]


def test_older_first_within_a_lane() -> None:
    jobs = [job("a", queued_at=5.0), job("b", queued_at=3.0)]
    assert [j.id for j in order_queue(jobs, replace(CONFIG, aging_per_s=0.0), now=10.0)] == ["b", "a"]


def test_plan_places_in_priority_order() -> None:
    # One slot (limit 0, nothing held): the paid job gets it although listed second.
    w = worker("w", warm=("sd",))
    jobs = [job("free", priority=priority("free")), job("paid", priority=priority("paid"))]
    placements = plan(jobs, [w], fleet(), replace(CONFIG, backlog_limit=0), now=0.0)
    assert [(p.job_id, p.worker_id) for p in placements] == [("paid", "w"), ("free", None)]


# 10. The decision is explained.


def test_placement_records_scored_candidates_and_a_reason() -> None:
    workers = [
        worker("cold"),
        worker("warm", warm=("sd",), held_jobs=1, held_work_s=3.0),
        worker("off", state=WorkerStatus.DRAINING),
    ]
    p = place(job("j1"), workers, fleet(), CONFIG)
    assert p.job_id == "j1"
    assert [(c.worker_id, c.eligible) for c in p.candidates] == [("cold", True), ("warm", True), ("off", False)]
    assert [c.finish_s for c in p.candidates] == [pytest.approx(9.0), pytest.approx(4.0), float("inf")]
    assert "cold" in p.candidates[0].note and "load" in p.candidates[0].note
    assert p.candidates[1].note == "warm"
    assert "earliest estimated finish" in p.reason and "4.00s" in p.reason


# Capabilities: a job goes only to a sampler that serves its model's capability.


def test_a_sampler_without_the_capability_is_no_candidate() -> None:
    image_only = worker("img", capabilities=frozenset({"image"}), warm=("vid",))
    both = worker("both", capabilities=frozenset({"image", "video"}))
    p = place(job(model="vid"), [image_only, both], fleet(), CONFIG)
    assert p.worker_id == "both"
    assert candidate(p, "img") == Candidate("img", False, float("inf"), "does not serve video")


def test_a_job_no_live_sampler_serves_waits_for_its_capability() -> None:
    p = place(job(model="vid"), [worker("img", capabilities=frozenset({"image"}))], fleet(), CONFIG)
    assert (p.worker_id, p.waiting_for, p.reason) == (None, "video", "no live sampler serves video")
    busy = place(
        job(), [worker("img", capabilities=frozenset({"image"}), state=WorkerStatus.DRAINING)], fleet(), CONFIG
    )
    assert busy.worker_id is None and busy.waiting_for == "", "a sampler that serves it is only busy"
