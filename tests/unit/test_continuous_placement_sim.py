"""Continuous batching in the event engine (scheduler/simulator/joining.py), placed
by Darkroom's production policy: a job placed on a GPU whose running batch has a
seat joins it at the next step boundary and runs its steps at the bigger batch's
step time, a member leaves when its own steps are done, the simulator's facts
show the seat as a sampler's heartbeat does, a suspended batch keeps each
member's own steps, and the same trace runs the same twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.simulator import scenario as scenarios
from scheduler.simulator.engine import Simulation
from scheduler.simulator.facts import WorldFacts
from scheduler.simulator.fleet import SimFleet
from scheduler.simulator.policies import DarkroomPolicy
from scheduler.simulator.trace import TraceJob
from scheduler.simulator.world import Gpu, Job
from services.generation import JoinKey
from services.seats import OpenSeat
from tests import fleets

# One 512 px step takes 0.1 s alone and 0.125 s in a batch of two (2 / 1.6 images per second).
MODEL = {
    "capability": "image",
    "step_s_512": 0.1,
    "load_s": 1,
    "vram_gb": 4,
    "max_batch": 2,
    "curve_images": [1, 2],
    "curve_images_per_s": [1.0, 1.6],
}
STEP_1, STEP_2 = 0.1, 0.125
JOBS = {f"s{n}": {"model": "img", "width": 512, "height": 512, "steps": n} for n in (4, 10)}


@pytest.fixture
def one_gpu(tmp_path: Path) -> scenarios.Scenario:
    data = fleets.scenario(
        simulation={"plan_interval_s": 0.15},
        models={"img": MODEL},
        jobs=JOBS,
        darkroom={"lanes": fleets.LANES},
        phases=[{"start_s": 0, "weights": {"s10": 1}}],
        gpus=[fleets.gpu("g", 1.0, 24, "img")],
    )
    return scenarios.load(fleets.write(tmp_path / "fleet.toml", data))


def trace(sc: scenarios.Scenario, *arrivals: tuple[float, str]) -> list[TraceJob]:
    """Jobs of the given types at the given times, each its true work without noise."""
    return [
        TraceJob(i, sc.job_types[t], at, sc.work_s(sc.job_types[t]), "free", 0) for i, (at, t) in enumerate(arrivals)
    ]


def run(sc: scenarios.Scenario, jobs: list[TraceJob], *, continuous: bool) -> dict[int, Job]:
    result = Simulation(sc, DarkroomPolicy(sc), jobs, load=0.5, continuous=continuous).run()
    assert not result.overloaded
    return {j.id: j for j in result.jobs}


def test_a_job_placed_on_a_batch_with_a_seat_joins_it_at_the_next_step(one_gpu: scenarios.Scenario) -> None:
    jobs = trace(one_gpu, (0.0, "s10"), (STEP_1, "s10"))
    done = run(one_gpu, jobs, continuous=True)
    # It joins one step in and runs 9 steps in a batch of two, its last alone once
    # the first job has left: not after the first job's batch.
    assert done[1].joined and done[1].gpu == "g" and done[1].start_s == pytest.approx(STEP_1)
    assert done[1].finish_s == pytest.approx(STEP_1 + 9 * STEP_2 + STEP_1)
    assert done[0].finish_s == pytest.approx(STEP_1 + 9 * STEP_2)
    # Batch-at-start, the same placement: it waits for the first job's batch.
    at_start = run(one_gpu, jobs, continuous=False)
    assert not at_start[1].joined
    assert (at_start[0].finish_s, at_start[1].finish_s) == pytest.approx((10 * STEP_1, 20 * STEP_1))


def test_a_member_with_fewer_steps_leaves_when_they_are_done(one_gpu: scenarios.Scenario) -> None:
    done = run(one_gpu, trace(one_gpu, (0.0, "s10"), (STEP_1, "s4")), continuous=True)
    assert done[1].finish_s == pytest.approx(STEP_1 + 4 * STEP_2)
    assert done[0].finish_s == pytest.approx(STEP_1 + 4 * STEP_2 + 5 * STEP_1)


def seats(sim: Simulation, gpu: Gpu, now: float) -> tuple[OpenSeat, ...]:
    return WorldFacts().worker(sim, gpu, now, None).open_seats


def test_the_facts_show_a_running_batch_s_seat_as_a_heartbeat_does(one_gpu: scenarios.Scenario) -> None:
    sim = Simulation(one_gpu, DarkroomPolicy(one_gpu), [], load=0.5, continuous=True)
    first, second, third = (Job(tj, "image", 0.0) for tj in trace(one_gpu, (0.0, "s10"), (0.0, "s4"), (0.0, "s4")))
    sim.pending += [first, second, third]
    sim.assign(first, "g", 0.0)
    gpu = sim.gpus["g"]
    # 2.5 steps in: the step under way counts as left.
    assert seats(sim, gpu, 2.5 * STEP_1) == (OpenSeat(JoinKey("img", 512, 512), rows=1, free_rows=1, steps_left=8),)
    # Offered, a joiner takes the seat at once (its steps counted), though it steps from the next boundary.
    sim.assign(second, "g", 2.5 * STEP_1)
    assert second.joined and seats(sim, gpu, 2.5 * STEP_1) == ()
    # Full, a job of its key waits in the queue.
    sim.assign(third, "g", 2.5 * STEP_1)
    assert gpu.batch == [first, second] and list(gpu.queue) == [third]


class _SuspendOnSecondTick:
    """Places every job on "g"; on its second tick, asks g's batch to suspend."""

    name = "suspend-on-second-tick"

    def __init__(self) -> None:
        self.ticks = 0

    def dispatch(self, sim: SimFleet, now: float) -> list[tuple[Job, str]]:
        return [(job, "g") for job in sim.pending]

    def on_done(
        self, sim: SimFleet, batch: list[Job], gpu: Gpu, run_s: float, now: float, *, rows: int | None = None
    ) -> None:
        pass

    def on_tick(self, sim: SimFleet, now: float) -> None:
        self.ticks += 1
        if self.ticks == 2:
            sim.suspend("g", now)


def test_a_suspended_batch_stops_at_its_next_boundary_each_member_keeping_its_steps(
    one_gpu: scenarios.Scenario,
) -> None:
    """Asked at 0.15 (the second tick), the batch of s10 (stepping from 0) and s4
    (joined at 0.1) stops at 0.225: s10 has 8 steps left, s4 3. Each resumes alone
    (a checkpoint read of 0.5 s, then its steps)."""
    jobs = trace(one_gpu, (0.0, "s10"), (STEP_1, "s4"))
    result = Simulation(one_gpu, _SuspendOnSecondTick(), jobs, load=0.5, continuous=True).run()
    first, second = result.jobs
    stopped = STEP_1 + STEP_2 + one_gpu.checkpoint_s
    assert (first.preemptions, second.preemptions, result.suspensions) == (1, 1, 1)
    resumed = stopped + one_gpu.resume_s + 8 * STEP_1
    assert (first.finish_s, second.finish_s) == pytest.approx((resumed, resumed + one_gpu.resume_s + 3 * STEP_1))


def test_the_same_trace_runs_the_same_twice(one_gpu: scenarios.Scenario) -> None:
    jobs = trace(one_gpu, *[(0.03 * i, ("s4", "s10")[i % 2]) for i in range(40)])
    runs = [run(one_gpu, jobs, continuous=True) for _ in range(2)]
    first, second = ([(j.gpu, j.start_s, j.finish_s, j.joined) for j in r.values()] for r in runs)
    assert first == second
    assert all(j.finish_s is not None for j in runs[0].values())
    assert any(j.joined for j in runs[0].values())
