"""The simulator runs every policy over a scenario file, loses no job, and the
benchmark prints the two figures its targets are stated in."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench import placement
from scheduler.simulator import lanes
from scheduler.simulator import scenario as scenarios
from scheduler.simulator import trace as traces
from scheduler.simulator.engine import Simulation
from scheduler.simulator.lanes import PREEMPTION_SCENARIO
from scheduler.simulator.policies import POLICIES, DarkroomPolicy
from scheduler.simulator.report import by_lane
from scheduler.simulator.world import Job
from services.config.fields import SettingsError
from tests import fleets

SMALL = fleets.scenario(
    simulation={"duration_s": 300, "seed": 3, "loads": [0.5, 0.85], "scan": [0.5, 0.85]},
    darkroom={"backlog_limit": 0, "capability_caps": {"video": 1}, "lanes": fleets.LANES},
    phases=[{"start_s": 0, "weights": {"img": 95, "vid": 5}}],
    gpus=[fleets.gpu("fast", 1.5, 24, "img"), fleets.gpu("slow", 0.5, 24, "vid"), fleets.gpu("small", 1.0, 12, "img")],
    thermal=[{"gpu": "fast", "start_s": 100, "end_s": 200, "temperature_c": 85, "slowdown": 0.7}],
    failures=[{"gpu": "small", "at_s": 150, "down_s": 30}],
)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return fleets.write(tmp_path / "small.toml", SMALL)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_finishes_every_job_on_a_gpu_that_fits_it(small: Path, name: str) -> None:
    sc = scenarios.load(small)
    trace = traces.trace(sc, 0.85)
    result = Simulation(sc, POLICIES[name](sc), trace, load=0.85).run()
    assert not result.overloaded
    assert sorted(j.id for j in result.jobs) == [t.id for t in trace]
    for job in result.jobs:
        assert job.finish_s is not None and job.start_s is not None
        assert job.trace.arrival_s <= job.start_s < job.finish_s
        # The 20 GB video model never ran on the 12 GB GPU.
        assert not (job.model == "vid" and job.gpu == "small")


def test_darkroom_learns_speeds_and_plans_warm_sets_in_the_simulation(small: Path) -> None:
    sc = scenarios.load(small)
    policy = DarkroomPolicy(sc)
    Simulation(sc, policy, traces.trace(sc, 0.85), load=0.85).run()
    speeds = {w: policy.durations.speed(w) for w in ("fast", "slow")}
    assert speeds["fast"] > 2 * speeds["slow"]  # true speeds 1.5 (1.05 while hot) and 0.5
    assert policy.primaries  # the planning loop ran and assigned primaries


def test_trace_is_reproducible_and_follows_the_load(small: Path) -> None:
    sc = scenarios.load(small)
    a, b = traces.trace(sc, 0.5), traces.trace(sc, 0.5)
    assert [(t.arrival_s, t.type.name) for t in a] == [(t.arrival_s, t.type.name) for t in b]
    assert len(traces.trace(sc, 0.85)) > len(a)


def test_bad_scenario_names_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    fleets.write(path, fleets.changed(SMALL, jobs={"vid": {"model": "nope"}}))
    with pytest.raises(scenarios.ScenarioError, match=r"jobs\.vid: unknown model 'nope'"):
        scenarios.load(path)


def test_benchmark_ends_with_the_two_target_lines(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert placement.main(["--scenario", str(small), "--processes", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"p99_ratio_vs_best_seed=\d+\.\d\d", lines[-2])
    assert re.fullmatch(r"sustainable_load=\d\.\d\d/\d\.\d\d", lines[-1])
    assert any(line.startswith("| darkroom | 85% |") for line in lines)


BATCHY = fleets.scenario(
    simulation={"duration_s": 240, "seed": 5, "noise_sigma": 0.0},
    darkroom={"backlog_limit": 1},
    models={"img": {**fleets.IMAGE, "max_batch": 4, "batch_efficiency": [1.0, 1.3, 1.6, 1.9]}},
    jobs={"img": fleets.JOBS["img"]},
    phases=[{"start_s": 0, "weights": {"img": 1}}],
    gpus=[fleets.gpu("a", 1.0, 24, "img"), fleets.gpu("b", 1.0, 24, "img")],
)


def test_batch_efficiency_curve_extends_with_its_last_slope(tmp_path: Path) -> None:
    img = fleets.load(tmp_path, BATCHY).models["img"]
    assert [img.batch_factor(k) for k in (1, 2, 4, 6)] == pytest.approx([1.0, 1.3, 1.9, 2.5])
    assert replace(img, batch_efficiency=()).batch_factor(3) == 3.0  # no curve: linear


def test_batching_carries_a_load_one_job_at_a_time_cannot(tmp_path: Path) -> None:
    """At 1.5x what the fleet runs one job at a time, Darkroom's placement forms
    batches and keeps up; without batching the same trace overloads it."""
    batched_path, alone_path = tmp_path / "batchy.toml", tmp_path / "alone.toml"
    fleets.write(batched_path, BATCHY)
    fleets.write(alone_path, fleets.changed(BATCHY, models={"img": {"max_batch": 1}}))
    results = {}
    for name, path in (("batched", batched_path), ("alone", alone_path)):
        sc = scenarios.load(path)
        trace = traces.trace(sc, 1.5)
        results[name] = Simulation(sc, DarkroomPolicy(sc), trace, load=1.5).run()
    batched, alone = results["batched"], results["alone"]
    assert all(j.finish_s is not None for j in batched.jobs)
    together = {(j.gpu, j.start_s) for j in batched.jobs}
    assert len(together) < 0.6 * len(batched.jobs)  # most jobs shared their run with others
    waits = sorted(j.finish_s - j.trace.arrival_s for j in batched.jobs if j.finish_s is not None)
    alone_waits = sorted(j.finish_s - j.trace.arrival_s for j in alone.jobs if j.finish_s is not None)
    assert alone.overloaded or alone_waits[-1] > 10 * waits[-1]


# Preemption: a suspended job keeps its steps, and an urgent lane stops waiting for long work.

ONE_GPU = fleets.scenario(
    simulation={"duration_s": 60, "seed": 1, "noise_sigma": 0.0, "checkpoint_s": 0.05, "resume_s": 0.5},
    darkroom={
        "backlog_limit": 0,
        "lanes": {"urgent": {"priority": 10}, "batch": {"priority": 0}},
        "preemption": {"preemptible": ["video"], "preempting_lanes": ["urgent"]},
    },
    models={"img": {**fleets.IMAGE, "vram_gb": 8}, "vid": {**fleets.VIDEO, "vram_gb": 12}},
    jobs={"img": {**fleets.JOBS["img"], "lane": "urgent"}, "vid": {**fleets.JOBS["vid"], "steps": 40, "lane": "batch"}},
    phases=[{"start_s": 0, "weights": {"img": 1, "vid": 1}}],
    gpus=[fleets.gpu("g", 1.0, 24, "img", "vid")],
)


def one_gpu_run(tmp_path: Path, data: dict[str, Any], policy: str = "darkroom") -> dict[str, Job]:
    """A 40 s video from 0 s, and a 1 s urgent image arriving at 10.3 s."""
    sc = fleets.load(tmp_path, data, "one")
    lanes = {lane.name: lane.priority for lane in sc.darkroom.lanes}
    trace = [
        traces.TraceJob(0, sc.job_types["vid"], 0.0, 40.0, "batch", lanes["batch"]),
        traces.TraceJob(1, sc.job_types["img"], 10.3, 1.0, "urgent", lanes["urgent"]),
    ]
    result = Simulation(sc, POLICIES[policy](sc), trace, load=1.0).run()
    return {j.model: j for j in result.jobs}


def test_an_urgent_job_suspends_a_video_that_resumes_where_it_stopped(tmp_path: Path) -> None:
    jobs = one_gpu_run(tmp_path, ONE_GPU)
    video, image = jobs["vid"], jobs["img"]
    # The video stops at its step boundary (11 s) and writes its checkpoint (0.05 s).
    assert image.start_s == pytest.approx(11.05) and image.finish_s == pytest.approx(12.05)
    # It resumes after the image with its 29 steps left, reading its checkpoint back
    # (0.5 s): it loses no step, and its suspension counts no attempt.
    assert video.finish_s == pytest.approx(12.05 + 0.5 + 29.0)
    # Suspended once and resumed: two starts, two attempts (production's fencing
    # token counts each dispatch), and no failure.
    assert (video.preemptions, video.attempts, video.done) == (1, 2, 1.0)


def test_a_gpu_failing_before_the_suspension_is_done_loses_the_run_not_the_job(tmp_path: Path) -> None:
    # Asked to suspend at 10.3 s, the GPU fails at 10.8 s, before the step boundary:
    # no checkpoint was written, so the video starts over (another attempt) once
    # the GPU is back at 15.8 s, after the urgent image.
    failing = fleets.changed(ONE_GPU, failures=[{"gpu": "g", "at_s": 10.8, "down_s": 5.0}])
    jobs = one_gpu_run(tmp_path, failing)
    video, image = jobs["vid"], jobs["img"]
    assert image.finish_s == pytest.approx(16.8)
    assert video.finish_s == pytest.approx(56.8)
    assert (video.preemptions, video.attempts, video.suspend_requested) == (0, 2, False)


def test_without_preemption_configured_the_urgent_job_waits(tmp_path: Path) -> None:
    off = fleets.changed(ONE_GPU, darkroom={"preemption": {"preempting_lanes": []}})
    jobs = one_gpu_run(tmp_path, off)
    assert scenarios.load(tmp_path / "one.toml").preemption.enabled is False
    assert jobs["img"].finish_s == pytest.approx(41.0)
    assert jobs["vid"].preemptions == 0
    # The seeds' policies never preempt, whatever the scenario says.
    assert one_gpu_run(tmp_path, ONE_GPU, "shortest-queue")["img"].finish_s == pytest.approx(41.0)


def test_a_job_suspended_max_preemptions_times_runs_to_its_end(tmp_path: Path) -> None:
    once = fleets.changed(ONE_GPU, darkroom={"preemption": {"max_preemptions": 0}})
    assert one_gpu_run(tmp_path, once)["img"].finish_s == pytest.approx(41.0)


def test_preemption_scenario_keys_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    fleets.write(path, fleets.changed(ONE_GPU, jobs={"img": {"lane": "vip"}}))
    with pytest.raises(scenarios.ScenarioError, match=r"jobs\.img: unknown lane 'vip'"):
        scenarios.load(path)
    # The settings' own checks, naming the scenario's keys.
    fleets.write(path, fleets.changed(ONE_GPU, darkroom={"preemption": {"preempting_lanes": ["vip"]}}))
    with pytest.raises(SettingsError, match=r"darkroom\.preemption\.preempting_lanes names 'vip'"):
        scenarios.load(path)
    fleets.write(path, fleets.changed(ONE_GPU, darkroom={"preemption": {"preemptible": ["vidoe"]}}))
    with pytest.raises(SettingsError, match=r"darkroom\.preemption\.preemptible names 'vidoe', which is neither"):
        scenarios.load(path)
    fleets.write(path, fleets.changed(ONE_GPU, darkroom={"preemption": {"preempt_after": 1}}))
    with pytest.raises(SettingsError, match=r"darkroom\.preemption: unknown keys"):
        scenarios.load(path)


def test_preemption_keeps_the_urgent_lane_s_p99_low_on_a_fleet_busy_with_videos() -> None:
    """The shipped preemption scenario at 85%: four GPUs mostly running 40 s
    best-effort videos. Without preemption an interactive job that finds them all
    busy waits for a video to end; with it, for a video's next step."""
    sc = scenarios.load(PREEMPTION_SCENARIO)
    on, off = (lanes.run(sc, 0.85, preempt=p) for p in (True, False))
    p99 = {name: by_lane(r)["interactive"][2] for name, r in (("on", on), ("off", off))}
    assert p99["on"] < 10.0 and p99["off"] > 2 * p99["on"]
    assert on.suspensions > 0 and off.suspensions == 0
    assert all(j.finish_s is not None and j.done == 1.0 for j in on.jobs)
    assert max(j.preemptions for j in on.jobs) <= sc.preemption.max_preemptions
    assert all(j.preemptions == 0 for j in on.jobs if j.trace.lane == "interactive")


def test_a_gpu_whose_sampler_does_not_serve_video_never_runs_it(tmp_path: Path) -> None:
    """The simulator's GPUs advertise capabilities as production samplers do
    (DARKROOM_CAPABILITIES restricts them): every policy keeps video off the GPU
    that does not serve it, though it fits there."""
    serves_images = {**fleets.gpu("fast", 1.5, 24, "img"), "serves": ["image"]}
    path = fleets.write(tmp_path / "serves.toml", fleets.changed(SMALL, gpus=[serves_images, *SMALL["gpus"][1:]]))
    sc = scenarios.load(path)
    trace = traces.trace(sc, 0.5)
    for name in sorted(POLICIES):
        result = Simulation(sc, POLICIES[name](sc), trace, load=0.5).run()
        videos = [j for j in result.jobs if j.model == "vid"]
        assert videos and all(j.finish_s is not None and j.gpu == "slow" for j in videos), name


def test_a_gpu_may_serve_only_capabilities_some_model_has(tmp_path: Path) -> None:
    bad = {**fleets.gpu("fast", 1.5, 24, "img"), "serves": ["audio"]}
    path = fleets.write(tmp_path / "bad.toml", fleets.changed(SMALL, gpus=[bad, *SMALL["gpus"][1:]]))
    with pytest.raises(scenarios.ScenarioError, match="serves 'audio', which no model has"):
        scenarios.load(path)
