"""Placement onto open seats: a job of the join key of a batch a worker runs, where
its heartbeat says the batch has room, joins it at its next step instead of
waiting behind it. Plain data, the clock passed in.

Reference numbers: one step of "sd" (512x512) on a batch of k images takes
0.04 + 0.01 k s as learned (0.05 s alone, 0.08 s for 4, 0.09 s for 5); a job of
20 steps and one image runs 1 s alone."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from scheduler import facts, reports
from scheduler.estimates import Durations, Learned, Shape
from scheduler.placement import plan
from scheduler.policy import Fleet, JobView, ModelCost, PlacementKind, WorkerView, seat_join
from scheduler.scoring import score
from scheduler.views import worker_views
from services.config.placement import Lane, PlacementSettings
from services.db.records import HeldGroup
from services.db.states import JobStatus
from services.generation import BatchKey, JoinKey
from services.seats import OpenSeat
from tests.records import worker_record

GB = 1024**3
PIXELS = 512 * 512
SD = ModelCost("image", step_s_512=0.05, load_s=8.0, vram_bytes=4 * GB, max_batch=8)
XL = ModelCost("image", step_s_512=0.1, load_s=12.0, vram_bytes=12 * GB, max_batch=4)
SD_KEY = JoinKey("sd", 512, 512)
CONFIG = PlacementSettings(lanes=(Lane("paid", 10, 120.0), Lane("free", 0, 300.0)), backlog_limit=1)


def step_s(rows: int) -> float:
    return 0.04 + 0.01 * rows


LEARNED = Durations(shapes={Shape("sd", PIXELS, 20, k).key: Learned(20 * step_s(k), 10) for k in range(1, 9)})
FLEET = Fleet({"sd": SD, "xl": XL}, LEARNED)


def job(jid: str = "j", **overrides: Any) -> JobView:
    return replace(JobView(jid, "sd", width=512, height=512, steps=20, num_images=1), **overrides)


def worker(wid: str, **overrides: Any) -> WorkerView:
    base = WorkerView(wid, frozenset({"sd", "xl"}), frozenset({"sd"}), vram_total_bytes=0, vram_used_bytes=0)
    return replace(base, **overrides)


def running(wid: str, seat: OpenSeat, **overrides: Any) -> WorkerView:
    """A worker running a batch of ``seat``, what is left of it held as its work."""
    return worker(wid, held_jobs=1, held_work_s=seat.steps_left * step_s(seat.rows), open_seats=(seat,), **overrides)


def test_a_job_joins_the_running_batch_sooner_than_waiting_behind_it() -> None:
    busy = running("a", OpenSeat(SD_KEY, rows=4, free_rows=4, steps_left=20))  # 1.6 s left
    candidate = score(job(), busy, FLEET, CONFIG)
    assert candidate.kind == PlacementKind.SEAT
    # The step under way (0.08 s), then its 20 steps in a batch of 5 (0.09 s each).
    assert candidate.finish_s == pytest.approx(0.08 + 20 * 0.09)
    behind = score(job(), replace(busy, open_seats=()), FLEET, CONFIG)
    assert behind.kind == PlacementKind.WARM and behind.finish_s == pytest.approx(1.6 + 1.0)
    assert candidate.finish_s < behind.finish_s


def test_a_seat_is_chosen_over_a_cold_idle_worker_or_a_busier_one_but_not_over_an_idle_warm_one() -> None:
    seated = running("a", OpenSeat(SD_KEY, rows=4, free_rows=4, steps_left=20))
    cold = worker("b", warm_models=frozenset())  # 8 s to load first
    busier = worker("c", held_jobs=1, held_work_s=3.0)
    [placed] = plan([job()], [cold, busier, seated], FLEET, CONFIG, now=0.0)
    assert placed.worker_id == "a" and reports.placement_kind(placed) == PlacementKind.SEAT
    # Alone on an idle warm GPU it is done in 1 s, sooner than at the bigger batch's pace.
    [placed] = plan([job()], [cold, busier, seated, worker("d")], FLEET, CONFIG, now=0.0)
    assert placed.worker_id == "d" and reports.placement_kind(placed) == PlacementKind.WARM


@pytest.mark.parametrize(
    "other",
    [
        {"width": 768},  # another latent size
        {"model": "xl"},  # another model
        {"frames": 9},  # a video of the same frame size
        {"num_images": 3},  # more images than the batch has room for
    ],
)
def test_a_job_the_seat_cannot_take_waits_behind_the_running_batch(other: dict[str, Any]) -> None:
    busy = running("a", OpenSeat(SD_KEY, rows=6, free_rows=2, steps_left=20), warm_models=frozenset({"sd", "xl"}))
    candidate = score(job(**other), busy, FLEET, CONFIG)
    assert candidate.kind == PlacementKind.WARM
    assert candidate.finish_s > busy.held_work_s


def test_steps_and_guidance_may_differ_from_the_batch() -> None:
    busy = running("a", OpenSeat(SD_KEY, rows=4, free_rows=4, steps_left=20))
    candidate = score(job(steps=30, guidance_scale=3.0), busy, FLEET, CONFIG)
    assert candidate.kind == PlacementKind.SEAT
    assert candidate.finish_s == pytest.approx(0.08 + 30 * 0.09)


def test_two_jobs_of_one_pass_do_not_both_take_the_last_seat() -> None:
    seated = running("a", OpenSeat(SD_KEY, rows=7, free_rows=1, steps_left=40))
    busier = worker("b", held_jobs=1, held_work_s=3.0)
    first, second = plan([job("j1", queued_at=0.0), job("j2", queued_at=1.0)], [seated, busier], FLEET, CONFIG, now=2.0)
    assert (first.job_id, first.worker_id, reports.placement_kind(first)) == ("j1", "a", PlacementKind.SEAT)
    # The batch is full now: j2 would wait behind the whole of it (4.4 s left, plus
    # what j1 costs it) on "a", so it goes to "b" (3 s, then 1 s).
    assert second.worker_id == "b"
    assert all(c.kind != PlacementKind.SEAT for c in second.candidates)


def test_joining_grows_the_running_batch_by_what_the_bigger_step_costs_its_members() -> None:
    seat = OpenSeat(SD_KEY, rows=4, free_rows=4, steps_left=20)
    busy = running("a", seat)
    short = seat_join(job(steps=10), busy, FLEET)
    assert short is not None and short.seat == seat
    assert short.growth_s == pytest.approx(10 * (0.09 - 0.08))  # they share 10 steps
    # One with more steps than the batch has left runs on alone after the others leave.
    long = seat_join(job(steps=30), busy, FLEET)
    assert long is not None
    assert long.growth_s == pytest.approx(20 * (0.09 - 0.08) + 10 * 0.05)
    [placed] = plan([job(steps=10)], [busy], FLEET, CONFIG, now=0.0)
    assert placed.worker_id == "a"


def test_a_seat_needs_the_room_of_every_image_of_the_job() -> None:
    busy = running("a", OpenSeat(SD_KEY, rows=6, free_rows=2, steps_left=20))
    assert seat_join(job(num_images=2), busy, FLEET) is not None
    assert seat_join(job(num_images=3), busy, FLEET) is None


# -- from a sampler's heartbeat -----------------------------------------------------

SEAT = {"model": "sd", "width": 512, "height": 512, "frames": 1, "rows": 3, "free_rows": 5, "steps_left": 12}


def test_a_heartbeats_open_seats_reach_the_workers_view() -> None:
    record = worker_record("a", telemetry={"open_seats": [SEAT]})
    snapshot = facts.fleet_snapshot(datetime.now(UTC), workers=[record])
    [seat] = snapshot.workers[0].open_seats
    assert seat == OpenSeat(SD_KEY, rows=3, free_rows=5, steps_left=12)
    [view] = worker_views(snapshot, FLEET)
    assert view.open_seats == (seat,)


@pytest.mark.parametrize(
    "reported",
    [
        None,
        "sd",
        {"sd": SEAT},  # not a list
        [None, 3, "seat", []],
        [{**SEAT, "model": 7}],
        [{**SEAT, "model": ""}],
        [{k: v for k, v in SEAT.items() if k != "free_rows"}],
        [{**SEAT, "rows": "3"}],
        [{**SEAT, "width": 512.0}],
        [{**SEAT, "steps_left": True}],
        [{**SEAT, "free_rows": 0}],  # no room
        [{**SEAT, "steps_left": 0}],  # nothing left to run
        [{**SEAT, "height": -512}],
    ],
)
def test_malformed_open_seats_are_passed_over(reported: object) -> None:
    assert facts.open_seats({"open_seats": reported}) == ()
    record = worker_record("a", telemetry={"open_seats": reported, "models": {}})
    [view] = worker_views(facts.fleet_snapshot(datetime.now(UTC), workers=[record]), FLEET)
    assert view.open_seats == ()


def test_good_seats_beside_malformed_ones_are_kept() -> None:
    assert facts.open_seats({"open_seats": [{"model": None}, SEAT, 4]}) == (OpenSeat(SD_KEY, 3, 5, 12),)
    assert facts.open_seats({}) == ()


def test_jobs_sent_to_join_take_their_seats_before_the_next_pass_counts_them() -> None:
    """A job placed onto a seat waits (scheduled) on its worker until the sampler
    admits it: the next pass counts it in the running batch, not behind it."""
    record = worker_record("a", telemetry={"open_seats": [{**SEAT, "rows": 4, "free_rows": 2, "steps_left": 20}]})

    def group(status: JobStatus, steps: int, images: int, done: float = 0.0) -> HeldGroup:
        return HeldGroup("a", status, BatchKey("sd", 512, 512, steps, 7.5), images, images, 1, done)

    held = [group(JobStatus.RUNNING, 20, 4), group(JobStatus.SCHEDULED, 20, 1), group(JobStatus.SCHEDULED, 30, 2)]
    [view] = worker_views(facts.fleet_snapshot(datetime.now(UTC), workers=[record], held=held), FLEET)
    # The running batch (1.6 s), the first joiner's growth (20 steps at 0.09 s not
    # 0.08 s); the second finds one seat left for its two images, so it waits as a
    # batch of its own: 30 steps of 2 images, 3 s by the registry (no 30-step shape
    # is learned).
    assert view.held_work_s == pytest.approx(1.6 + 20 * 0.01 + 3.0)
    assert view.open_seats == (OpenSeat(SD_KEY, rows=5, free_rows=1, steps_left=20),)
    assert view.open_batches == ((BatchKey("sd", 512, 512, 30, 7.5), 2),)
    assert view.held_jobs == 2


def test_jobs_of_other_steps_running_in_one_batch_share_its_steps() -> None:
    def group(steps: int, images: int, done: float) -> HeldGroup:
        return HeldGroup("a", JobStatus.RUNNING, BatchKey("sd", 512, 512, steps, 7.5), images, images, 1, done)

    # 2 images with 10 of 20 steps left and 1 joined with 30 to go: 10 steps of 3
    # images (0.07 s), then 20 of the last one alone (0.05 s); one batch, one slot.
    held = [group(20, 2, 0.5), group(30, 1, 0.0)]
    [view] = worker_views(facts.fleet_snapshot(datetime.now(UTC), workers=[worker_record("a")], held=held), FLEET)
    assert view.held_work_s == pytest.approx(10 * 0.07 + 20 * 0.05)
    assert view.held_jobs == 1


def test_what_a_sampler_reports_the_scheduler_reads_back_as_it_was() -> None:
    seat = OpenSeat(JoinKey("sd", 512, 768, 1), rows=3, free_rows=5, steps_left=17)
    assert OpenSeat.of(seat.telemetry()) == seat
    assert facts.open_seats({"open_seats": [seat.telemetry()]}) == (seat,)
