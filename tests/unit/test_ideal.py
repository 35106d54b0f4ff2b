"""The ideal row of the placement benchmark: every model warm on every GPU it
fits, nothing to load, one central work-conserving queue, latency-bound work
first and suspending best-effort work when it finds no GPU free."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.simulator import scenario as scenarios
from scheduler.simulator import trace as traces
from scheduler.simulator.engine import Simulation
from scheduler.simulator.ideal import IdealPolicy, ideal_scenario
from scheduler.simulator.policies import DarkroomPolicy
from scheduler.simulator.report import summarize
from tests import fleets

# Two GPUs, images with targets (paid 10 s, free 30 s) and best-effort video.
TINY = fleets.scenario(
    simulation={
        "name": "tiny",
        "duration_s": 300,
        "seed": 3,
        "loads": [0.5, 0.85],
        "scan": [0.4, 0.6, 0.7, 0.85, 1.0],
        "p99_limit_s": 45,
    },
    darkroom={
        "backlog_limit": 0,
        "best_effort": ["video"],
        "capability_caps": {"video": 1},
        "lanes": {"paid": {"priority": 10, "target_s": 10}, "free": {"priority": 0, "target_s": 30}},
        "preemption": {"for_targets": True, "max_preemptions": 2},
    },
    phases=[{"start_s": 0, "weights": {"img": 90, "vid": 10}}],
    gpus=[fleets.gpu("fast", 1.5, 24, "img"), fleets.gpu("slow", 1.0, 24, "vid")],
    thermal=[{"gpu": "fast", "start_s": 100, "end_s": 200, "temperature_c": 85, "slowdown": 0.7}],
    failures=[{"gpu": "slow", "at_s": 150, "down_s": 30}],
)


@pytest.fixture
def tiny(tmp_path: Path) -> scenarios.Scenario:
    return fleets.load(tmp_path, TINY, "tiny")


def run_ideal(sc: scenarios.Scenario, trace: list[traces.TraceJob]) -> Simulation:
    world = ideal_scenario(sc)
    sim = Simulation(world, IdealPolicy(world), trace, load=1.0)
    sim.run()
    return sim


def test_the_ideal_scenario_keeps_the_fleet_and_takes_away_every_load(tiny: scenarios.Scenario) -> None:
    ideal = ideal_scenario(tiny)
    assert all(m.load_s == 0 for m in ideal.models.values())
    assert (ideal.checkpoint_s, ideal.resume_s) == (0.0, 0.0)
    assert [(g.id, g.speed, g.vram_gb) for g in ideal.gpus] == [(g.id, g.speed, g.vram_gb) for g in tiny.gpus]
    assert all(g.pinned == ("img", "vid") for g in ideal.gpus)  # both fit both GPUs
    assert (ideal.thermal, ideal.failures) == (tiny.thermal, tiny.failures)
    assert traces.trace(ideal, 0.85) == traces.trace(tiny, 0.85)


@pytest.mark.parametrize("load", [0.5, 0.85, 1.0])
def test_it_finishes_every_job_and_never_pays_a_load(tiny: scenarios.Scenario, load: float) -> None:
    trace = traces.trace(tiny, load)
    world = ideal_scenario(tiny)
    result = Simulation(world, IdealPolicy(world), trace, load=load).run()
    assert not result.overloaded
    assert sorted(j.id for j in result.jobs) == [t.id for t in trace]
    assert all(j.finish_s is not None and j.done == 1.0 for j in result.jobs)
    assert (result.cold_loads, result.preloads) == (0, 0)
    assert not any(j.cold for j in result.jobs)
    # Latency-bound jobs are never suspended; the failure (slow, 150-180 s) sent its jobs back.
    assert all(j.preemptions == 0 for j in result.jobs if not j.trace.best_effort)


def test_a_latency_bound_job_finding_every_gpu_on_video_suspends_one(tiny: scenarios.Scenario) -> None:
    """Two 30 s videos from 0 s (20 s on the fast GPU); an image with a 10 s
    target at 10.3 s suspends the slow GPU's video (the most work left) at its
    next step boundary (11 s), runs there, and the video resumes where it stopped."""
    vid, img = tiny.job_types["vid"], tiny.job_types["img"]
    trace = [
        traces.TraceJob(0, vid, 0.0, 30.0, "free", 0, None),
        traces.TraceJob(1, vid, 0.0, 30.0, "free", 0, None),
        traces.TraceJob(2, img, 10.3, 1.0, "paid", 10, 10.0),
    ]
    sim = run_ideal(tiny, trace)
    jobs = {j.id: j for j in sim.jobs}
    assert sim.suspensions == 1
    assert jobs[2].gpu == "slow" and jobs[2].start_s == pytest.approx(11.0) and jobs[2].finish_s == pytest.approx(12.0)
    suspended = [j for j in sim.jobs if j.preemptions]
    assert [j.id for j in suspended] == [1]
    # 11 of its 30 steps done; the remaining 19 run on the first GPU free (slow, at 12 s).
    assert jobs[1].gpu == "slow" and jobs[1].finish_s == pytest.approx(31.0)
    assert jobs[0].gpu == "fast" and jobs[0].finish_s == pytest.approx(20.0)


def test_best_effort_work_waits_and_suspends_nothing(tiny: scenarios.Scenario) -> None:
    vid = tiny.job_types["vid"]
    trace = [traces.TraceJob(i, vid, 0.0, 30.0, "free", 0, None) for i in range(3)]
    sim = run_ideal(tiny, trace)
    assert sim.suspensions == 0
    # The first two start at once, on both GPUs; the third on the first free one (fast, at 20 s).
    assert sorted(j.finish_s or 0.0 for j in sim.jobs) == pytest.approx([20.0, 30.0, 40.0])


@pytest.mark.parametrize("load", [0.5, 0.85])
def test_its_image_p99_is_no_worse_than_darkroom_s(tiny: scenarios.Scenario, load: float) -> None:
    trace = traces.trace(tiny, load)
    world = ideal_scenario(tiny)
    ideal = summarize(Simulation(world, IdealPolicy(world), trace, load=load).run())
    darkroom = summarize(Simulation(tiny, DarkroomPolicy(tiny), trace, load=load).run())
    assert ideal.p99("image") <= darkroom.p99("image")
