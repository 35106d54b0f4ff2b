"""The step-level simulator (scheduler/simulator/stepping.py): continuous batching
lets a job join a running batch at its next step and a member leave when its own
steps are done, batch-at-start does neither, a batch's step is timed by the
scenario's batch-size curve, and a run is the same twice whatever the hash seed."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.simulator import scenario as scenarios
from scheduler.simulator import trace as traces
from scheduler.simulator.stepping import Mode, simulate
from scheduler.simulator.trace import TraceJob
from tests import fleets

REPO = Path(__file__).resolve().parents[2]
# One 512 px step takes 0.1 s alone and 0.125 s in a batch of two (2 / 1.6 images per second).
MODEL = {"capability": "image", "step_s_512": 0.1, "load_s": 1, "vram_gb": 4, "max_batch": 2}
CURVE = {"curve_images": [1, 2], "curve_images_per_s": [1.0, 1.6]}
STEP_1, STEP_2 = 0.1, 0.125
JOBS = {f"s{n}": {"model": "img", "width": 512, "height": 512, "steps": n} for n in (4, 10)}


def fleet(tmp_path: Path, *gpu_ids: str) -> scenarios.Scenario:
    data = fleets.scenario(
        models={"img": {**MODEL, **CURVE}},
        jobs=JOBS,
        darkroom={"lanes": fleets.LANES},
        phases=[{"start_s": 0, "weights": {"s10": 1}}],
        gpus=[fleets.gpu(g, 1.0, 24, "img") for g in gpu_ids],
    )
    return scenarios.load(fleets.write(tmp_path / "fleet.toml", data))


@pytest.fixture
def one_gpu(tmp_path: Path) -> scenarios.Scenario:
    return fleet(tmp_path, "g")


def jobs(sc: scenarios.Scenario, *arrivals: tuple[float, str]) -> list[TraceJob]:
    return [TraceJob(i, sc.job_types[t], at, 0.0, "free", 0) for i, (at, t) in enumerate(arrivals)]


def finish(sc: scenarios.Scenario, trace: list[TraceJob], mode: Mode) -> dict[int, float]:
    return {f.job: f.finish_s for f in simulate(sc, trace, mode).finished}


def test_a_job_arriving_one_step_into_a_batch_joins_it_rather_than_waiting(one_gpu: scenarios.Scenario) -> None:
    trace = jobs(one_gpu, (0.0, "s10"), (STEP_1, "s10"))
    continuous = simulate(one_gpu, trace, Mode.CONTINUOUS)
    done = {f.job: f for f in continuous.finished}
    # It joins at the first boundary and runs its 10 steps, 9 in a batch of two and
    # the last alone once the first job has left.
    assert done[1].joined and done[1].start_s == pytest.approx(STEP_1)
    assert done[1].latency_s == pytest.approx(9 * STEP_2 + STEP_1)
    assert done[0].finish_s == pytest.approx(STEP_1 + 9 * STEP_2)
    assert continuous.busy_s == continuous.makespan_s == pytest.approx(STEP_1 + 9 * STEP_2 + STEP_1)
    # Batch-at-start: it waits for the first job's batch to end, then runs alone.
    assert finish(one_gpu, trace, Mode.AT_START) == pytest.approx({0: 10 * STEP_1, 1: 20 * STEP_1})


def test_a_member_with_fewer_steps_leaves_early_and_the_rest_go_on(one_gpu: scenarios.Scenario) -> None:
    trace = jobs(one_gpu, (0.0, "s10"), (0.0, "s4"))
    # Together for 4 steps; then the 10-step job goes on alone, at the one-image step time.
    assert finish(one_gpu, trace, Mode.CONTINUOUS) == pytest.approx({1: 4 * STEP_2, 0: 4 * STEP_2 + 6 * STEP_1})
    # Today's batch key holds the steps: the two cannot share a batch.
    assert finish(one_gpu, trace, Mode.AT_START) == pytest.approx({0: 10 * STEP_1, 1: 14 * STEP_1})


def test_batch_at_start_batches_jobs_of_one_key_that_waited(one_gpu: scenarios.Scenario) -> None:
    trace = jobs(one_gpu, (0.0, "s4"), (0.1, "s4"), (0.2, "s4"))
    # The second and third wait for the first, then run as one batch of two.
    assert finish(one_gpu, trace, Mode.AT_START) == pytest.approx({0: 0.4, 1: 0.4 + 4 * STEP_2, 2: 0.4 + 4 * STEP_2})


def test_a_full_batch_has_no_seat_until_a_member_leaves(one_gpu: scenarios.Scenario) -> None:
    trace = jobs(one_gpu, (0.0, "s4"), (0.0, "s10"), (0.05, "s4"))
    done = finish(one_gpu, trace, Mode.CONTINUOUS)
    # max_batch 2: the third joins when the 4-step job leaves, and runs beside the
    # 10-step one, whose last 2 steps are alone.
    assert done == pytest.approx({0: 4 * STEP_2, 2: 8 * STEP_2, 1: 8 * STEP_2 + 2 * STEP_1})


def test_jobs_arriving_together_past_one_batch_start_on_every_idle_gpu(tmp_path: Path) -> None:
    two = fleet(tmp_path, "a", "b")
    for mode in Mode:
        run = simulate(two, jobs(two, *[(0.0, "s4")] * 3), mode)
        assert {f.job: f.gpu for f in run.finished} == {0: "a", 1: "a", 2: "b"}
        assert {f.job: f.finish_s for f in run.finished} == pytest.approx({0: 4 * STEP_2, 1: 4 * STEP_2, 2: 4 * STEP_1})


def test_the_curve_is_interpolated_between_measured_sizes_and_extended_past_them() -> None:
    h200 = scenarios.load(REPO / "scheduler/simulator/continuous_scenario.toml").models["sd15"]
    at = {n: n / rate * 1.656 for n, rate in zip((1, 2, 4, 8), (1.656, 3.184, 4.813, 6.630), strict=True)}
    assert h200.batch_factor(1) == 1.0
    assert h200.batch_factor(8) == pytest.approx(at[8])
    assert h200.batch_factor(3) == pytest.approx((at[2] + at[4]) / 2)
    assert h200.batch_factor(10) == pytest.approx(at[8] + (at[8] - at[4]) / 2)


@pytest.mark.parametrize(
    "curve",
    [
        {"curve_images": [2, 4], "curve_images_per_s": [1.0, 1.5]},
        {"curve_images": [1, 2], "curve_images_per_s": [1.0]},
        {**CURVE, "batch_efficiency": [1.0, 1.2]},
    ],
)
def test_a_bad_curve_names_the_problem(tmp_path: Path, curve: dict[str, list[float]]) -> None:
    data = fleets.scenario(models={"img": {**MODEL, **curve}}, jobs=JOBS, gpus=[fleets.gpu("g", 1.0, 24, "img")])
    with pytest.raises(scenarios.ScenarioError, match=r"models\.img"):
        scenarios.load(fleets.write(tmp_path / "bad.toml", data))


def test_the_same_trace_gives_the_same_run_twice() -> None:
    sc = replace(scenarios.load(REPO / "scheduler/simulator/continuous_scenario.toml"), duration_s=30.0)
    trace = traces.trace(sc, 2.0)
    for mode in Mode:
        first = simulate(sc, trace, mode)
        assert first == simulate(sc, trace, mode)
        assert len(first.finished) == len(trace)


def test_the_bench_prints_the_same_whatever_the_hash_seed() -> None:
    def run(hash_seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        command = [sys.executable, "bench/continuous_batching.py", "--smoke"]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout

    assert run("1") == run("2")
