"""Placement that knows adapter warmth, over plain data: a job whose adapter is
resident on one GPU goes there rather than to an equal GPU that would load it
first; a later job of the same pass sees the adapter resident where the first
went; a GPU's own measured load time wins over the configured guess; and the
sampler's heartbeat facts become the scheduler's view. Reference numbers as
``test_batch_placement``'s: an "sd" job runs 1 s alone."""

from __future__ import annotations

from dataclasses import replace

from scheduler import facts
from scheduler.placement import place, plan
from scheduler.views import worker_view
from services.config.placement import PlacementSettings
from tests.unit.test_batch_placement import CONFIG, fleet, job, worker

STYLE = frozenset({"style:v1"})


def test_a_job_goes_where_its_adapter_is_resident_when_the_rest_is_equal() -> None:
    cold, warm = worker("a", adapter_load_s=0.4), worker("b", adapters=STYLE, adapter_load_s=0.4)
    placement = place(job("j", adapters=STYLE), [cold, warm], fleet(), CONFIG)
    assert placement.worker_id == "b"
    reasons = {c.worker_id: c.note for c in placement.candidates}
    assert "loads 1 adapter (+0.4s)" in reasons["a"] and "adapter" not in reasons["b"]
    # Without adapters the two are the same, and the first wins.
    assert place(job("k"), [cold, warm], fleet(), CONFIG).worker_id == "a"


def test_loading_an_adapter_is_worth_it_where_the_resident_gpu_is_busier() -> None:
    busy = worker("b", adapters=STYLE, held_jobs=1, held_work_s=2.0, adapter_load_s=0.4)
    assert place(job("j", adapters=STYLE), [worker("a", adapter_load_s=0.4), busy], fleet(), CONFIG).worker_id == "a"


def test_a_later_job_of_the_pass_sees_the_adapter_where_the_first_one_went() -> None:
    gpus = [worker("a", adapter_load_s=5.0), worker("b", held_jobs=1, held_work_s=3.0, adapter_load_s=5.0)]
    placements = plan([job("j1", adapters=STYLE), job("j2", adapters=STYLE, steps=30)], gpus, fleet(), CONFIG, now=0.0)
    # The first loads the adapter on a (6 s); the second, of another batch key, finds
    # it resident there: 6 + 1.5 s beats b's 3 s of work, 1.5 s and a 5 s load.
    assert [p.worker_id or p.reserved_on for p in placements] == ["a", "a"]


def test_the_heartbeat_says_what_is_resident_and_what_a_load_took() -> None:
    from datetime import UTC, datetime

    from services.db.states import WorkerKind, WorkerStatus
    from services.db.worker_records import WorkerRecord

    now = datetime.now(UTC)
    telemetry = {"adapters": ["style:v1", 3, "subject:v2"], "adapter_load_s": 0.25}
    record = WorkerRecord(
        "w1",
        WorkerKind.SAMPLER,
        "",
        "cpu",
        WorkerStatus.READY,
        ("sd",),
        ("sd",),
        0,
        0,
        0.0,
        1.0,
        0,
        0,
        0.0,
        telemetry,
        now,
        now,
    )
    seen = facts.worker(record)
    assert seen.adapters == frozenset({"style:v1", "subject:v2"}) and seen.adapter_load_s == 0.25
    view = worker_view(seen, [], replace(fleet(), adapter_load_s=9.0))
    assert view.adapter_load_s == 0.25
    unmeasured = worker_view(replace(seen, adapter_load_s=0.0), [], replace(fleet(), adapter_load_s=9.0))
    assert unmeasured.adapter_load_s == 9.0
    assert PlacementSettings().adapter_load_s == 0.5


def test_in_the_simulator_adapter_aware_placement_loads_fewer_adapters_than_blind() -> None:
    from scheduler.simulator import scenario as scenarios
    from scheduler.simulator import trace as traces
    from scheduler.simulator.engine import Simulation
    from scheduler.simulator.policies import AdapterBlindPolicy, DarkroomPolicy

    sc = replace(scenarios.load(scenarios.DEFAULT_SCENARIO.with_name("adapters_scenario.toml")), duration_s=300.0)
    jobs = traces.trace(sc, 0.5)
    assert len({j.adapter for j in jobs}) > 50  # the long tail is there
    aware = Simulation(sc, DarkroomPolicy(sc), jobs, load=0.5).run()
    blind = Simulation(sc, AdapterBlindPolicy(sc), jobs, load=0.5).run()
    assert all(j.finish_s is not None for j in (*aware.jobs, *blind.jobs))
    assert aware.adapter_loads < 0.9 * blind.adapter_loads, (aware.adapter_loads, blind.adapter_loads)
