"""Placement with batching: compatible jobs gather on a GPU where the learned batch
durations say it pays; retries go elsewhere. Plain data, the clock passed in.

Reference numbers: an "sd" job (512x512, 20 steps, 1 image) runs 1 s alone; with
the learned batch durations below, a batch of k runs 1 + 0.2 (k - 1) s."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scheduler.estimates import Durations, Learned, Shape
from scheduler.placement import place, plan
from scheduler.policy import Fleet, JobView, ModelCost, WorkerView
from services.config.placement import Lane, PlacementSettings
from services.generation import BatchKey

GB = 1024**3
SD = ModelCost("image", step_s_512=0.05, load_s=8.0, vram_bytes=4 * GB, max_batch=4)
PIXELS = 512 * 512
BATCHED = Durations(shapes={Shape("sd", PIXELS, 20, k).key: Learned(1 + 0.2 * (k - 1), 10) for k in range(1, 5)})
KEY = BatchKey("sd", 512, 512, 20, 7.5)
CONFIG = PlacementSettings(lanes=(Lane("paid", 10, 120.0), Lane("free", 0, 300.0)), backlog_limit=1)


def job(jid: str, **overrides: Any) -> JobView:
    return replace(JobView(jid, "sd", width=512, height=512, steps=20, num_images=1), **overrides)


def worker(wid: str, **overrides: Any) -> WorkerView:
    base = WorkerView(wid, frozenset({"sd"}), frozenset({"sd"}), vram_total_bytes=0, vram_used_bytes=0)
    return replace(base, **overrides)


def fleet(costs: ModelCost = SD, durations: Durations = BATCHED) -> Fleet:
    return Fleet({"sd": costs}, durations)


def test_a_job_joins_an_open_batch_for_what_the_batch_grows_by() -> None:
    busy = worker("a", held_jobs=2, held_work_s=0.5, open_batches=((KEY, 1),))
    idle = worker("b")
    placement = place(job("j"), [busy, idle], fleet(), CONFIG)
    # 0.5 s of held work plus 0.2 s of growth beats 1 s alone on the idle GPU,
    # and the full backlog does not keep it out: the batch is already in it.
    assert placement.worker_id == "a"
    assert "joins a batch of 1" in placement.reason


def test_an_idle_gpu_wins_when_joining_would_wait_longer() -> None:
    busy = worker("a", held_jobs=1, held_work_s=2.0, open_batches=((KEY, 1),))
    assert place(job("j"), [busy, worker("b")], fleet(), CONFIG).worker_id == "b"


def test_only_jobs_of_the_same_key_join_and_only_while_the_batch_has_room() -> None:
    busy = worker("a", held_jobs=2, held_work_s=0.5, open_batches=((KEY, 3),))
    other_steps = place(job("j", steps=30), [busy], fleet(), CONFIG)
    assert other_steps.worker_id is None and other_steps.reserved_on == "a"
    too_many = place(job("j", num_images=2), [busy], fleet(), CONFIG)
    assert too_many.worker_id is None
    assert place(job("j"), [busy], fleet(), CONFIG).worker_id == "a"


def test_a_busy_fleet_forms_batches_where_it_would_otherwise_queue() -> None:
    workers = [worker("a", held_jobs=1, held_work_s=2.0), worker("b", held_jobs=1, held_work_s=2.0)]
    jobs = [job(f"j{i}", queued_at=float(i)) for i in range(6)]
    batched = plan(jobs, workers, fleet(), CONFIG, now=10.0)
    assert all(p.worker_id is not None for p in batched)
    assert sorted(str(p.worker_id) for p in batched) == ["a", "a", "a", "b", "b", "b"]
    alone = plan(jobs, workers, fleet(replace(SD, max_batch=1)), CONFIG, now=10.0)
    assert sum(p.worker_id is not None for p in alone) == 2  # one per backlog slot; the rest wait


def test_joining_must_pay_by_the_learned_durations() -> None:
    # Learned: a batch of 2 takes 2.5 s, more than two jobs one after the other.
    worse = Durations(
        shapes={Shape("sd", PIXELS, 20, 1).key: Learned(1.0, 9), Shape("sd", PIXELS, 20, 2).key: Learned(2.5, 9)}
    )
    busy = worker("a", held_jobs=2, held_work_s=0.5, open_batches=((KEY, 1),))
    placement = place(job("j"), [busy], fleet(durations=worse), CONFIG)
    assert placement.worker_id is None  # it waits for a slot instead of slowing the batch


def test_a_retry_goes_to_another_gpu_when_one_can_take_it() -> None:
    best, other = worker("a"), worker("b", held_work_s=0.5)
    assert place(job("j", failed_on=frozenset({"a"})), [best, other], fleet(), CONFIG).worker_id == "b"
    # The only GPU that can run it still does.
    assert place(job("j", failed_on=frozenset({"a"})), [best], fleet(), CONFIG).worker_id == "a"


def test_an_unlearned_batch_size_scales_from_the_nearest_learned_one() -> None:
    durations = Durations(
        shapes={Shape("sd", PIXELS, 20, 1).key: Learned(2.0, 9), Shape("sd", PIXELS, 20, 4).key: Learned(4.0, 9)}
    )
    assert durations.shape_seconds(Shape("sd", PIXELS, 20, 2), 0.05) == 4.0  # nearest is 1: 2.0 x 2
    assert durations.shape_seconds(Shape("sd", PIXELS, 20, 3), 0.05) == 3.0  # nearest is 4: 4.0 x 3/4
    assert durations.shape_seconds(Shape("sd", PIXELS, 30, 1), 0.05) == 0.05 * 30  # nothing learned


def test_measured_load_times_and_footprints_correct_the_registry() -> None:

    from scheduler import facts
    from scheduler.costs import measured_costs
    from scheduler.snapshot import Worker
    from tests.records import worker_record

    def sampler(wid: str, models: dict[str, dict[str, float]]) -> Worker:
        return facts.worker(worker_record(wid, telemetry={"models": models}))

    workers = [
        sampler("a", {"sd": {"bytes": 5 * GB, "load_s": 3.0}}),
        sampler("b", {"sd": {"bytes": 2 * GB, "load_s": 4.0}, "unknown": {"bytes": 1, "load_s": 1.0}}),
        sampler("c", {"sd": {"bytes": 2 * GB, "load_s": 20.0}}),
        sampler("d", {}),
    ]
    corrected = measured_costs({"sd": SD}, workers)
    assert set(corrected) == {"sd"}
    assert corrected["sd"].load_s == 4.0  # the median: one slow disk does not set it
    assert corrected["sd"].vram_bytes == 5 * GB  # larger than the registry's 4 GB
    assert measured_costs({"sd": SD}, [sampler("d", {})])["sd"] == SD


def test_the_work_a_worker_holds_is_counted_from_groups_of_its_jobs() -> None:

    from datetime import UTC, datetime

    from scheduler import facts
    from scheduler.views import worker_views
    from services.db.records import HeldGroup
    from services.db.states import JobStatus
    from tests.records import worker_record

    record = worker_record("a")

    def group(status: JobStatus, steps: int, images: int, done: float = 0.0) -> HeldGroup:
        return HeldGroup("a", status, BatchKey("sd", 512, 512, steps, 7.5), images, images, 1, done)

    groups = [
        group(JobStatus.RUNNING, 20, 2, done=0.5),  # a batch of 2 half done: 1.2 s of which 0.6 s left
        group(JobStatus.SCHEDULED, 20, 3),  # waiting, of the same key: one batch of 3, 1.4 s, open to more
        group(JobStatus.SCHEDULED, 30, 1),  # another key: its own batch (1.5 s from the registry)
        group(JobStatus.DECODING, 20, 4),  # decoding frees the GPU: no work here
        replace(group(JobStatus.SCHEDULED, 20, 1), worker_id="b"),  # another worker's
    ]
    [view] = worker_views(facts.fleet_snapshot(datetime.now(UTC), workers=[record], held=groups), fleet())
    assert view.held_jobs == 3  # batches: the running one and two waiting
    assert abs(view.held_work_s - (0.6 + 1.4 + 1.5)) < 1e-9
    assert view.open_batches == (
        (BatchKey("sd", 512, 512, 20, 7.5), 3),
        (BatchKey("sd", 512, 512, 30, 7.5), 1),
    )
    assert view.held_capabilities == frozenset({"image"})


def test_a_placement_says_whether_it_is_warm_cold_or_joins_a_batch() -> None:
    from scheduler.policy import PlacementKind
    from scheduler.reports import placement_kind

    cold = worker("c", warm_models=frozenset())
    joinable = worker("b", held_jobs=1, held_work_s=0.5, open_batches=((KEY, 1),))
    for chosen, kind in (
        (worker("w"), PlacementKind.WARM),
        (cold, PlacementKind.COLD),
        (joinable, PlacementKind.BATCH),
    ):
        placement = place(job("j"), [chosen], fleet(), CONFIG)
        assert placement.worker_id == chosen.id and placement_kind(placement) == kind
