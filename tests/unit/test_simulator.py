"""The simulator runs every policy over a scenario file, loses no job, and the
benchmark prints the two figures its targets are stated in."""

from __future__ import annotations

import re
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
