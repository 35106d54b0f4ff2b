from __future__ import annotations

from datetime import UTC, datetime

from scheduler.policy import JobView, ModelCost, WorkerView, place, plan, run_seconds

NOW = datetime(2026, 1, 1, tzinfo=UTC)
GB = 1024**3
COSTS = {
    "sd": ModelCost(step_s_512=0.05, load_s=8.0, vram_bytes=4 * GB),
    "big": ModelCost(step_s_512=0.1, load_s=20.0, vram_bytes=30 * GB),
}


def job(model: str = "sd", steps: int = 20, size: int = 512, n: int = 1, jid: str = "j") -> JobView:
    return JobView(jid, model, size, size, steps, n)


def worker(
    wid: str,
    *,
    warm: tuple[str, ...] = (),
    models: tuple[str, ...] = ("sd", "big"),
    held: int = 0,
    work: float = 0.0,
    speed: float = 1.0,
    vram: int = 24 * GB,
    used: int = 0,
) -> WorkerView:
    return WorkerView(wid, frozenset(models), frozenset(warm), vram, used, speed, held, work)


def test_run_seconds_scales_with_steps_pixels_images_and_speed() -> None:
    base = run_seconds(job(), COSTS["sd"], 1.0)
    assert base == 20 * 0.05
    assert run_seconds(job(steps=40), COSTS["sd"], 1.0) == 2 * base
    assert run_seconds(job(size=1024), COSTS["sd"], 1.0) == 4 * base
    assert run_seconds(job(n=3), COSTS["sd"], 1.0) == 3 * base
    assert run_seconds(job(), COSTS["sd"], 2.0) == base / 2


def test_prefers_warm_worker_over_idle_cold_one() -> None:
    p = place(job(), [worker("cold"), worker("warm", warm=("sd",), held=1, work=3.0)], COSTS, now=NOW, backlog_limit=4)
    assert p.worker_id == "warm"


def test_loads_model_when_warm_worker_is_busier_than_the_load() -> None:
    p = place(job(), [worker("cold"), worker("warm", warm=("sd",), held=2, work=30.0)], COSTS, now=NOW, backlog_limit=4)
    assert p.worker_id == "cold"


def test_balances_on_estimated_work_not_queue_length() -> None:
    # One long job ahead is worse than three short ones.
    p = place(
        job(),
        [worker("one-long", warm=("sd",), held=1, work=90.0), worker("three-short", warm=("sd",), held=3, work=3.0)],
        COSTS,
        now=NOW,
        backlog_limit=4,
    )
    assert p.worker_id == "three-short"


def test_faster_worker_wins_when_equally_loaded() -> None:
    p = place(
        job(), [worker("slow", warm=("sd",)), worker("fast", warm=("sd",), speed=2.0)], COSTS, now=NOW, backlog_limit=4
    )
    assert p.worker_id == "fast"


def test_worker_that_cannot_fit_the_model_is_not_a_candidate() -> None:
    p = place(
        job("big"),
        [worker("small", vram=16 * GB), worker("large", vram=80 * GB, held=2, work=50)],
        COSTS,
        now=NOW,
        backlog_limit=4,
    )
    assert p.worker_id == "large"
    small = next(c for c in p.candidates if c.worker_id == "small")
    assert not small.eligible and "fit" in small.note


def test_eviction_costs_extra_when_memory_is_short() -> None:
    crowded = worker("crowded", vram=24 * GB, used=22 * GB)
    roomy = worker("roomy", vram=24 * GB, used=0, held=1, work=5.0)
    p = place(job(), [crowded, roomy], COSTS, now=NOW, backlog_limit=4)
    assert p.worker_id == "roomy"
    assert "evicts" in next(c for c in p.candidates if c.worker_id == "crowded").note


def test_worker_without_the_model_is_not_a_candidate() -> None:
    p = place(job(), [worker("other", models=("big",))], COSTS, now=NOW, backlog_limit=4)
    assert p.worker_id is None
    assert "no live worker" in p.reason


def test_full_backlog_keeps_the_job_queued_centrally() -> None:
    p = place(job(), [worker("busy", warm=("sd",), held=3, work=10)], COSTS, now=NOW, backlog_limit=2)
    assert p.worker_id is None
    assert "busy" in p.reason


def test_unknown_model_is_not_placed() -> None:
    assert place(job("nope"), [worker("w")], COSTS, now=NOW, backlog_limit=2).worker_id is None


def test_plan_spreads_a_burst_by_accumulating_work() -> None:
    jobs = [job(jid=f"j{i}") for i in range(4)]
    placements = plan(jobs, [worker("a", warm=("sd",)), worker("b", warm=("sd",))], COSTS, now=NOW, backlog_limit=10)
    assert [p.worker_id for p in placements] == ["a", "b", "a", "b"]


def test_plan_respects_backlog_across_the_pass() -> None:
    jobs = [job(jid=f"j{i}") for i in range(5)]
    placements = plan(jobs, [worker("a", warm=("sd",))], COSTS, now=NOW, backlog_limit=1)
    assert [p.worker_id for p in placements] == ["a", "a", None, None, None]


def test_plan_counts_the_model_as_warm_after_placing_it() -> None:
    jobs = [job(jid="first"), job(jid="second")]
    placements = plan(jobs, [worker("a"), worker("b", held=1, work=8.5)], COSTS, now=NOW, backlog_limit=10)
    # After "first" makes a warm (load 8 + run 1 = 9 s), "second" finishes sooner
    # on a (9 + 1) than on b (8.5 + 8 load + 1).
    assert [p.worker_id for p in placements] == ["a", "a"]
