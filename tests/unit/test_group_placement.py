"""Placement of groups, over plain data: a group's spanning jobs are estimated at
its own speed (a first guess from its devices, then learned apart from the jobs its
leader runs alone), a cap counts a group's every device, and the heartbeat's group
size is read defensively."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from scheduler import facts
from scheduler.estimates import Durations, Learned
from scheduler.facts import group_size
from scheduler.learning import fold_run_times
from scheduler.placement import plan
from scheduler.policy import GROUP_EFFICIENCY, Fleet, WorkerView, job_seconds, speed_id
from scheduler.simulator.engine import Simulation
from scheduler.simulator.facts import WorldFacts
from scheduler.simulator.policies import DarkroomPolicy
from services.db.records import RunTime
from tests import fleets
from tests.records import worker_record
from tests.unit.test_policy import CONFIG, COSTS, job, worker

# "vid2": the video model as a 2-GPU replica; "sd" stays single.
GROUP_COSTS = {**COSTS, "vid2": replace(COSTS["vid"], parallel_size=2)}


def fleet(**overrides: object) -> Fleet:
    return replace(Fleet(GROUP_COSTS), **overrides)  # type: ignore[arg-type]


def test_a_group_s_spanning_jobs_are_first_guessed_from_its_devices() -> None:
    group, single = worker("g", gpus=2), worker("s")
    f = fleet()
    assert job_seconds(job(model="vid2"), single, f) == 10.0  # a single GPU runs it unsplit
    assert job_seconds(job(model="vid2"), group, f) == 10.0 / (2 * GROUP_EFFICIENCY)
    assert job_seconds(job(model="sd"), group, f) == job_seconds(job(model="sd"), single, f)  # its leader alone


def test_a_group_s_learned_spanning_speed_is_its_own() -> None:
    group = worker("g", gpus=2)
    assert speed_id(group, GROUP_COSTS["vid2"]) == ("g@span", 2 * GROUP_EFFICIENCY)
    assert speed_id(group, GROUP_COSTS["sd"]) == ("g", 1.0)
    learned = fleet(durations=Durations(speeds={"g@span": Learned(1.9, 10), "g": Learned(1.0, 10)}))
    # The same work: spanning, the group runs it at 1.9 times its leader alone.
    spanning, alone = job_seconds(job(model="vid2"), group, learned), job_seconds(job(model="vid"), group, learned)
    assert abs(spanning * 1.9 - alone) < 1e-9


def grouped(wid: str, **overrides: object) -> WorkerView:
    """A ready worker that serves every model, ``vid2`` warm."""
    return replace(worker(wid, models=tuple(GROUP_COSTS)), warm_models=frozenset({"vid2"}), **overrides)  # type: ignore[arg-type]


def test_the_group_takes_its_spanning_job_over_an_idle_single_gpu() -> None:
    group, single = grouped("g", gpus=2), grouped("s")
    [placed] = plan([job(model="vid2")], [single, group], fleet(), CONFIG, now=0.0)
    assert placed.worker_id == "g"


def test_a_cap_counts_each_device_of_a_group() -> None:
    capped = replace(CONFIG, capability_caps=(("video", 2),))
    group = worker("g", models=("vid2",), gpus=2, holds=("video",), held_jobs=1, held_work_s=100.0)
    idle = worker("s", warm=("vid",))
    # The group's video holds both GPUs of the cap of 2: with images queued, no third.
    jobs = [job("v", model="vid", priority=1), job("i", model="sd")]
    placed = {p.job_id: p.worker_id for p in plan(jobs, [group, idle], fleet(), capped, now=0.0)}
    assert placed == {"v": None, "i": "s"}
    single_holder = replace(group, gpus=1)
    placed = {p.job_id: p.worker_id for p in plan(jobs, [single_holder, idle], fleet(), capped, now=0.0)}
    assert placed["v"] == "s"


def test_a_spanning_run_is_learned_as_the_group_s_own_speed() -> None:
    fact = RunTime("vid2", 512 * 512, 20, 1, "g", 5.0)
    _, speeds = fold_run_times(GROUP_COSTS, {}, {}, [fact], {"g": 2})
    assert set(speeds) == {"g@span"}
    _, speeds = fold_run_times(GROUP_COSTS, {}, {}, [replace(fact, model="sd")], {"g": 2})
    assert set(speeds) == {"g"}


def test_a_heartbeat_s_group_size_is_read_defensively() -> None:
    assert group_size({"group": {"size": 4}}) == 4
    assert group_size({}) == 1
    assert group_size({"group": {"size": "4"}}) == 1
    assert group_size({"group": {"size": True}}) == 1
    assert group_size({"group": [4]}) == 1
    assert group_size({"group": {"size": 0}}) == 1


def test_the_simulator_and_production_see_a_group_alike(tmp_path: Path) -> None:
    """A simulated group of two is the worker production's facts make of a group's
    heartbeat; it runs the model it spans at its speed-up, and one it does not alone."""
    sc = fleets.load(
        tmp_path,
        fleets.scenario(
            simulation={"duration_s": 60, "seed": 1},
            models={"img": fleets.IMAGE, "vid": {**fleets.VIDEO, "parallel_size": 2, "group_speedup": 1.7}},
            phases=[{"start_s": 0, "weights": {"img": 1}}],
            gpus=[{**fleets.gpu("g", 1.0, 24), "gpus": 2}],
        ),
    )
    sim = Simulation(sc, DarkroomPolicy(sc), [], load=0.5)
    gpu = sim.gpus["g"]
    simulated = WorldFacts().worker(sim, gpu, 0.0, None)
    produced = facts.worker(worker_record("g", ("img", "vid"), telemetry={"group": {"size": 2}}))
    assert simulated.gpus == produced.gpus == 2
    assert sim.run_speed(gpu, "vid", 0.0) == 1.7 and sim.run_speed(gpu, "img", 0.0) == 1.0
    assert sc.phase_capacity(sc.phases[0]) == 2 / sc.phase_work_s(sc.phases[0])  # both its GPUs count
