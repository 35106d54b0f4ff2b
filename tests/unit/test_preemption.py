"""Preemption rules of scheduler.preemption, one test per rule, over plain data;
and its adapters in scheduler.views.

Reference numbers: an "sd" job (512x512, 20 steps, 1 image) runs 1 s on a
speed-1.0 worker and its model loads in 8 s; a "vid" job (30 steps) runs 30 s
and its steps take 1 s. Workers are warm for "sd" unless a test says otherwise.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from scheduler import facts
from scheduler.estimates import Durations, Learned
from scheduler.placement import plan
from scheduler.policy import Candidate, Fleet, JobView, ModelCost, Placement, WorkerView
from scheduler.preemption import Preemption, RunningView, choose_preemptions, estimated_wait
from scheduler.snapshot import FleetSnapshot
from scheduler.views import job_view, running_views
from services.config.placement import Lane, PlacementSettings, PreemptionSettings
from services.db.records import RunningJobRecord
from services.generation import JobShape
from tests import records

GB = 1024**3
COSTS = {
    "sd": ModelCost("image", step_s_512=0.05, load_s=8.0, vram_bytes=4 * GB),
    "vid": ModelCost("video", step_s_512=1.0, load_s=12.0, vram_bytes=12 * GB),
}
FLEET = Fleet(COSTS)
CONFIG = PreemptionSettings(preemptible=frozenset({"video"}), preempting_lanes=frozenset({"paid"}), for_targets=False)


def job(jid: str = "urgent", model: str = "sd", **overrides: Any) -> JobView:
    return replace(JobView(jid, model, width=512, height=512, steps=20, num_images=1, priority=10), **overrides)


def worker(wid: str, *, warm: tuple[str, ...] = ("sd",), **overrides: Any) -> WorkerView:
    base = WorkerView(wid, frozenset(COSTS), frozenset(warm), 24 * GB, sum(COSTS[m].vram_bytes for m in warm))
    return replace(base, **overrides)


def running(
    jid: str,
    wid: str,
    *,
    lane: str = "free",
    capability: str = "video",
    step_s: float = 1.0,
    remaining_s: float = 30.0,
    preemptions: int = 0,
    suspend_requested: bool = False,
) -> RunningView:
    model = "vid" if capability == "video" else "sd"
    return RunningView(jid, 1, wid, lane, capability, model, preemptions, suspend_requested, step_s, remaining_s)


def waits(jid: str = "urgent", lane: str = "paid", **finish: float | None) -> tuple[JobView, str, Placement]:
    """A job the pass left queued, with its candidates' estimated finish per
    worker (None: an ineligible worker)."""
    candidates = tuple(
        Candidate(w, f is not None, f if f is not None else float("inf"), "warm" if f is not None else "cannot")
        for w, f in finish.items()
    )
    return job(jid), lane, Placement(jid, None, "waits", candidates)


def choose(
    waiting: list[tuple[JobView, str, Placement]],
    jobs: list[RunningView],
    config: PreemptionSettings = CONFIG,
    workers: list[WorkerView] | None = None,
) -> list[Preemption]:
    if workers is None:
        ids = {c.worker_id for _, _, p in waiting for c in p.candidates} | {r.worker_id for r in jobs}
        workers = [worker(w) for w in sorted(ids)]
    return choose_preemptions(waiting, jobs, config, now=100.0, workers=workers, fleet=FLEET)


def victims(preemptions: list[Preemption]) -> list[tuple[str, str, str]]:
    return [(p.job_id, p.worker_id, p.for_job_id) for p in preemptions]


# Every GPU busy with a video with 30 s left: the urgent job waits 30 s anywhere.
BUSY = [running("v-a", "a"), running("v-b", "b")]


def test_an_urgent_job_behind_long_videos_suspends_one() -> None:
    chosen = choose([waits(a=31.0, b=31.0)], BUSY)
    assert victims(chosen) == [("v-a", "a", "urgent")]
    assert chosen[0].attempt == 1
    assert "urgent" in chosen[0].reason and "v-a" in chosen[0].reason


# 1. Nothing happens when disabled, for a lane that may not preempt, or for a short wait.


@pytest.mark.parametrize(
    "config",
    [
        PreemptionSettings(for_targets=False),
        replace(CONFIG, preemptible=frozenset()),
        replace(CONFIG, preempting_lanes=frozenset()),
        replace(CONFIG, max_preemptions=0),
    ],
)
def test_nothing_is_preempted_when_preemption_is_disabled(config: PreemptionSettings) -> None:
    assert not config.enabled
    assert choose([waits(a=31.0, b=31.0)], BUSY, config) == []


def test_a_job_of_a_lane_that_may_not_preempt_waits() -> None:
    assert choose([waits(lane="free", a=31.0, b=31.0)], BUSY) == []
    assert choose([waits(lane="paid", a=31.0, b=31.0)], BUSY) != []


def test_a_job_that_would_wait_no_longer_than_preempt_after_s_waits() -> None:
    # Its wait is its finish less its own 1 s run: 2 s is not more than 2 s.
    assert choose([waits(a=3.0, b=3.0)], BUSY) == []
    assert choose([waits(a=3.01, b=3.01)], BUSY) != []


def test_the_wait_is_the_finish_less_the_job_s_own_run_and_load() -> None:
    # 4.5 s finish on a warm speed-1 worker: 3.5 s of waiting. On a half-speed
    # worker the run is 2 s (2.5 s of waiting); cold, the 8 s load is no wait.
    pending = waits(a=4.5)
    urgent, _, placement = pending
    assert estimated_wait(urgent, placement, {"a": worker("a")}, FLEET) == pytest.approx(3.5)
    assert choose([pending], BUSY[:1], workers=[worker("a")]) != []
    assert choose([pending], BUSY[:1], workers=[worker("a", speed=0.5)]) != []
    assert choose([waits(a=3.5)], BUSY[:1], workers=[worker("a", speed=0.5)]) == []
    assert choose([waits(a=10.5)], BUSY[:1], workers=[worker("a", warm=())]) == []  # 9 s run + load, 1.5 s wait
    assert choose([waits(a=10.5)], BUSY[:1], workers=[worker("a")]) != []


def test_the_wait_is_the_least_over_the_eligible_candidates() -> None:
    # b frees in 1 s: the job waits for it rather than suspend a's video.
    short = [running("v-a", "a"), running("img", "b", capability="image", remaining_s=1.0)]
    assert choose([waits(a=31.0, b=2.0)], short) == []
    # An ineligible worker's (infinite) finish is no wait of the job's.
    assert choose([waits(a=31.0, b=None)], short) != []


# 2. Only an eligible candidate's preemptible running job, not yet preempted too often.


def test_only_a_worker_that_is_an_eligible_candidate_may_be_freed() -> None:
    # c would free soonest (0.1 s step) but cannot take the job (say, it does not fit).
    jobs = [*BUSY, running("v-c", "c", step_s=0.1)]
    assert victims(choose([waits(a=31.0, b=31.0, c=None)], jobs)) == [("v-a", "a", "urgent")]
    assert victims(choose([waits(a=31.0, b=31.0)], jobs)) == [("v-a", "a", "urgent")]  # c no candidate
    assert victims(choose([waits(a=31.0, b=31.0, c=31.0)], jobs)) == [("v-c", "c", "urgent")]


@pytest.mark.parametrize(
    ("lane", "capability", "preemptible"),
    [("free", "image", False), ("free", "video", True), ("batch", "image", True), ("batch", "video", True)],
)
def test_a_running_job_is_preemptible_by_its_lane_or_its_capability(
    lane: str, capability: str, preemptible: bool
) -> None:
    config = replace(CONFIG, preemptible=frozenset({"video", "batch"}))
    jobs = [running("r", "a", lane=lane, capability=capability)]
    assert bool(choose([waits(a=31.0)], jobs, config)) is preemptible


def test_a_job_preempted_max_preemptions_times_is_not_preempted_again() -> None:
    tired = [running("v-a", "a", preemptions=2), running("v-b", "b", preemptions=1, step_s=5.0)]
    assert victims(choose([waits(a=31.0, b=31.0)], tired)) == [("v-b", "b", "urgent")]
    assert choose([waits(a=31.0, b=31.0)], tired, replace(CONFIG, max_preemptions=1)) == []


def test_a_worker_running_a_batch_is_freed_whole_or_not_at_all() -> None:
    batch = [running("v-2", "a"), running("v-1", "a")]
    assert victims(choose([waits(a=31.0)], batch)) == [("v-1", "a", "urgent"), ("v-2", "a", "urgent")]
    mixed = [running("v-1", "a"), running("img", "a", capability="image")]
    assert choose([waits(a=31.0)], mixed) == []


# 3. The job that frees a suitable GPU soonest.


def test_the_shortest_step_goes_first() -> None:
    # a's job suspends in 0.5 s but the job runs 2 s there (2.5 s); b's in 1 s, run 1 s (2 s).
    jobs = [running("v-a", "a", step_s=0.5), running("v-b", "b", step_s=1.0)]
    workers = [worker("a", speed=0.5), worker("b")]
    assert victims(choose([waits(a=32.0, b=31.0)], jobs, workers=workers)) == [("v-a", "a", "urgent")]


def test_work_queued_behind_the_running_job_counts_against_its_worker() -> None:
    # a's video steps faster, but a holds 20 s more work the job would wait for.
    jobs = [running("v-a", "a", step_s=0.5), running("v-b", "b", step_s=1.0)]
    assert victims(choose([waits(a=51.0, b=31.0)], jobs)) == [("v-b", "b", "urgent")]


def test_then_the_worker_where_the_job_would_finish_soonest() -> None:
    jobs = [running("v-a", "a"), running("v-b", "b")]
    workers = [worker("a"), worker("b", speed=2.0)]  # the job runs 1 s on a, 0.5 s on b
    assert victims(choose([waits(a=31.0, b=30.5)], jobs, workers=workers)) == [("v-b", "b", "urgent")]


def test_then_the_job_preempted_fewest_times() -> None:
    jobs = [running("v-a", "a", preemptions=1), running("v-b", "b")]
    assert victims(choose([waits(a=31.0, b=31.0)], jobs)) == [("v-b", "b", "urgent")]


def test_then_the_job_id_whatever_the_input_order() -> None:
    jobs = [running("v2", "a"), running("v1", "b"), running("v3", "c")]
    pending = waits(a=31.0, b=31.0, c=31.0)
    for _ in range(5):
        random.shuffle(jobs)
        assert victims(choose([pending], jobs)) == [("v1", "b", "urgent")]


# 4. Freeing must help.


def test_a_worker_whose_freeing_would_not_finish_the_job_sooner_is_left_alone() -> None:
    # Freed, a still runs 30 s of queued work first (done at 32 s); b finishes the
    # job at 10 s as things are, running an image job nothing may preempt.
    jobs = [running("v-a", "a"), running("img", "b", capability="image", remaining_s=9.0)]
    assert choose([waits(a=61.0, b=10.0)], jobs) == []
    assert victims(choose([waits(a=31.0, b=10.0)], jobs)) == [("v-a", "a", "urgent")]


# 5. Room already being made; each running job for one waiting job; waiting jobs in order.


def test_a_pending_suspension_on_an_eligible_worker_counts_as_room() -> None:
    asked = [running("v-a", "a", suspend_requested=True), running("v-b", "b")]
    assert choose([waits(a=31.0, b=31.0)], asked) == []
    # Not where the job cannot run: there it is no room for it.
    assert victims(choose([waits(a=None, b=31.0)], asked)) == [("v-b", "b", "urgent")]


def test_a_pending_suspension_is_claimed_by_one_waiting_job() -> None:
    asked = [running("v-a", "a", suspend_requested=True), running("v-b", "b"), running("v-c", "c")]
    first, second = waits("first", a=31.0, b=31.0, c=31.0), waits("second", a=31.0, b=31.0, c=31.0)
    assert victims(choose([first, second], asked)) == [("v-b", "b", "second")]


def test_a_job_already_asked_to_suspend_is_not_asked_again() -> None:
    asked = [running("v-a", "a", suspend_requested=True, step_s=0.1)]
    assert choose([waits("first", a=31.0), waits("second", a=31.0)], asked) == []


def test_each_running_job_is_suspended_for_one_waiting_job_in_the_order_given() -> None:
    first, second, third = (waits(j, a=31.0, b=31.0) for j in ("first", "second", "third"))
    assert victims(choose([first, second, third], BUSY)) == [("v-a", "a", "first"), ("v-b", "b", "second")]
    assert victims(choose([third, first], BUSY)) == [("v-a", "a", "third"), ("v-b", "b", "first")]


# 6. A job of a preempting lane is never preempted.


def test_a_job_of_a_preempting_lane_is_never_preempted_even_if_its_capability_is_listed() -> None:
    paid_video = [running("v-a", "a", lane="paid")]
    assert choose([waits(a=31.0)], paid_video) == []
    assert choose([waits(a=31.0)], [running("v-a", "a", lane="free")]) != []


# 7. Deterministic whatever the hash seed.

_SCRIPT = """
import json
from tests.unit.test_preemption import BUSY, choose, running, waits
jobs = [*BUSY, *(running(f"v{i}", f"w{i}") for i in range(20))]
pending = [waits(f"u{k}", **{r.worker_id: 31.0 for r in jobs}) for k in range(12)]
print(json.dumps([[p.job_id, p.worker_id, p.for_job_id, p.reason] for p in choose(pending, jobs)]))
"""


def test_the_same_inputs_give_the_same_preemptions_whatever_the_hash_seed() -> None:
    root = Path(__file__).resolve().parents[2]
    outputs = []
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True, check=True
        )
        outputs.append(json.loads(done.stdout))
    assert len(outputs[0]) == 12
    assert outputs[0] == outputs[1] == outputs[2]


# With the placement policy: what the pass leaves queued goes straight in.


def test_plan_leaves_an_urgent_job_queued_behind_videos_and_the_rule_frees_a_gpu() -> None:
    busy = [
        worker(w, warm=("sd", "vid"), held_jobs=1, held_work_s=25.0, held_capabilities=frozenset({"video"}))
        for w in ("a", "b")
    ]
    urgent = job(queued_at=99.0)
    placements = plan(
        [urgent], busy, FLEET, PlacementSettings(lanes=(Lane("paid", 10), Lane("free", 0)), backlog_limit=0), now=100.0
    )
    assert placements[0].worker_id is None and placements[0].reserved_on == "a"
    jobs = [running("v-b", "b", remaining_s=25.0, step_s=0.5), running("v-a", "a", remaining_s=25.0)]
    chosen = choose_preemptions([(urgent, "paid", placements[0])], jobs, CONFIG, now=100.0, workers=busy, fleet=FLEET)
    assert victims(chosen) == [("v-b", "b", "urgent")]
    assert "waiting 1.0s" in chosen[0].reason


# Adapters: database records.


def fleet_of(jobs: list[RunningJobRecord], workers: list[str]) -> FleetSnapshot:
    """The running ``jobs`` on ready workers of speed 1, as the database has them."""
    now = datetime(2025, 1, 1, 0, 5, tzinfo=UTC)
    return facts.fleet_snapshot(now, workers=[records.worker_record(w) for w in workers], running=jobs)


def test_running_views_estimate_the_step_and_the_rest_at_the_worker_s_speed() -> None:
    learned = Fleet(COSTS, Durations(speeds={"a": Learned(2.0, 10), "b": Learned(1.0, 10)}))
    (fast,) = running_views(fleet_of([records.running_job()], ["a", "b"]), learned)
    # Mean learned speed is held at 1: a runs at 4/3, so 1 s steps take 0.75 s.
    assert replace(fast, remaining_s=0.0) == RunningView("v", 2, "a", "free", "video", "vid", 1, False, 0.75, 0.0)
    assert fast.remaining_s == pytest.approx(15.0)
    (unlearned,) = running_views(
        fleet_of([records.running_job(progress_step=25, suspend_requested=True)], ["a"]), FLEET
    )
    assert (unlearned.step_s, unlearned.suspend_requested) == (1.0, True)
    assert unlearned.remaining_s == pytest.approx(5.0)


def test_a_running_job_of_an_unknown_model_is_never_chosen() -> None:
    (view,) = running_views(fleet_of([records.running_job(shape=JobShape("gone", 512, 512, 30, 7.5, 1))], ["a"]), FLEET)
    assert view.capability == "" and view.step_s == float("inf")
    config = replace(CONFIG, preemptible=frozenset({"free"}))
    assert choose([waits(a=31.0)], [view], config) == []


def test_a_preempted_job_ages_from_its_suspension() -> None:
    created, suspended = datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 1, 1, 0, 1, tzinfo=UTC)
    summary = records.summary(id="v", lane="free", model="vid", width=512, height=512, steps=30, created_at=created)
    view = job_view(facts.queued_job(summary), PlacementSettings(), {})
    assert view.queued_at == created.timestamp()
    resumed = job_view(facts.queued_job(replace(summary, aged_from=suspended)), PlacementSettings(), {})
    assert resumed.queued_at == suspended.timestamp()
