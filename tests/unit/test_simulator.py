"""The simulator runs every policy over a scenario file, loses no job, and the
benchmark prints the two figures its targets are stated in."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from bench import placement
from scheduler.simulator import scenario as scenarios
from scheduler.simulator.engine import Simulation
from scheduler.simulator.policies import POLICIES, DarkroomPolicy

SMALL = """
[simulation]
duration_s = 300
seed = 3
loads = [0.5, 0.85]
scan = [0.5, 0.85]

[darkroom]
capability_caps = { video = 1 }
[darkroom.lanes.paid]
priority = 10
[darkroom.lanes.free]
priority = 0

[models.img]
capability = "image"
step_s_512 = 0.05
load_s = 5
vram_gb = 10

[models.vid]
capability = "video"
step_s_512 = 1.0
load_s = 8
vram_gb = 20

[jobs.img]
model = "img"
width = 512
height = 512
steps = 20

[jobs.vid]
model = "vid"
width = 512
height = 512
steps = 30

[[phases]]
start_s = 0
weights = { img = 95, vid = 5 }

[[gpus]]
id = "fast"
speed = 1.5
vram_gb = 24
pinned = ["img"]

[[gpus]]
id = "slow"
speed = 0.5
vram_gb = 24
pinned = ["vid"]

[[gpus]]
id = "small"
speed = 1.0
vram_gb = 12
pinned = ["img"]

[[thermal]]
gpu = "fast"
start_s = 100
end_s = 200
temperature_c = 85
slowdown = 0.7

[[failures]]
gpu = "small"
at_s = 150
down_s = 30
"""


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    return path


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_finishes_every_job_on_a_gpu_that_fits_it(small: Path, name: str) -> None:
    sc = scenarios.load(small)
    trace = scenarios.trace(sc, 0.85)
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
    Simulation(sc, policy, scenarios.trace(sc, 0.85), load=0.85).run()
    speeds = {w: policy.durations.speed(w) for w in ("fast", "slow")}
    assert speeds["fast"] > 2 * speeds["slow"]  # true speeds 1.5 (1.05 while hot) and 0.5
    assert policy.primaries  # the planning loop ran and assigned primaries


def test_trace_is_reproducible_and_follows_the_load(small: Path) -> None:
    sc = scenarios.load(small)
    a, b = scenarios.trace(sc, 0.5), scenarios.trace(sc, 0.5)
    assert [(t.arrival_s, t.type.name) for t in a] == [(t.arrival_s, t.type.name) for t in b]
    assert len(scenarios.trace(sc, 0.85)) > len(a)


def test_bad_scenario_names_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(SMALL.replace('model = "vid"', 'model = "nope"'))
    with pytest.raises(scenarios.ScenarioError, match=r"jobs\.vid: unknown model 'nope'"):
        scenarios.load(path)


def test_benchmark_ends_with_the_two_target_lines(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert placement.main(["--scenario", str(small), "--processes", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"p99_ratio_vs_best_seed=\d+\.\d\d", lines[-2])
    assert re.fullmatch(r"sustainable_load=\d\.\d\d/\d\.\d\d", lines[-1])
    assert any(line.startswith("| darkroom | 85% |") for line in lines)


BATCHY = """
[simulation]
duration_s = 240
seed = 5
noise_sigma = 0.0

[darkroom]
backlog_limit = 1

[models.img]
capability = "image"
step_s_512 = 0.05
load_s = 5
vram_gb = 10
max_batch = 4
batch_efficiency = [1.0, 1.3, 1.6, 1.9]

[jobs.img]
model = "img"
width = 512
height = 512
steps = 20

[[phases]]
start_s = 0
weights = { img = 1 }

[[gpus]]
id = "a"
speed = 1.0
vram_gb = 24
pinned = ["img"]

[[gpus]]
id = "b"
speed = 1.0
vram_gb = 24
pinned = ["img"]
"""


def test_batch_efficiency_curve_extends_with_its_last_slope(tmp_path: Path) -> None:
    path = tmp_path / "batchy.toml"
    path.write_text(BATCHY)
    img = scenarios.load(path).models["img"]
    assert [img.batch_factor(k) for k in (1, 2, 4, 6)] == pytest.approx([1.0, 1.3, 1.9, 2.5])
    assert replace(img, batch_efficiency=()).batch_factor(3) == 3.0  # no curve: linear


def test_batching_carries_a_load_one_job_at_a_time_cannot(tmp_path: Path) -> None:
    """At 1.5x what the fleet runs one job at a time, Darkroom's placement forms
    batches and keeps up; without batching the same trace overloads it."""
    batched_path, alone_path = tmp_path / "batchy.toml", tmp_path / "alone.toml"
    batched_path.write_text(BATCHY)
    alone_path.write_text(BATCHY.replace("max_batch = 4", "max_batch = 1"))
    results = {}
    for name, path in (("batched", batched_path), ("alone", alone_path)):
        sc = scenarios.load(path)
        trace = scenarios.trace(sc, 1.5)
        results[name] = Simulation(sc, DarkroomPolicy(sc), trace, load=1.5).run()
    batched, alone = results["batched"], results["alone"]
    assert all(j.finish_s is not None for j in batched.jobs)
    together = {(j.gpu, j.start_s) for j in batched.jobs}
    assert len(together) < 0.6 * len(batched.jobs)  # most jobs shared their run with others
    waits = sorted(j.finish_s - j.trace.arrival_s for j in batched.jobs if j.finish_s is not None)
    alone_waits = sorted(j.finish_s - j.trace.arrival_s for j in alone.jobs if j.finish_s is not None)
    assert alone.overloaded or alone_waits[-1] > 10 * waits[-1]
