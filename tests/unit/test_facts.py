"""Production and the simulator fill the same fleet snapshot.

Production fills it from database records (``scheduler/facts.py``), the simulator
from its world (``scheduler/simulator/facts.py``); everything after the snapshot
is one driver. Here one fleet state is set up both ways, each fact written down
once per side, and the two fillers must agree on every fact. The one thing they
may tell differently is how far running work is: production reads the steps
done, the simulator knows when the run began; both must leave the same work.

The state, on one clock (seconds since the epoch, ``BASE`` + the offsets below,
all exact in binary so that times and durations compare exactly), at ``NOW`` =
BASE + 11.5:

* ``fast`` (speed 2, 24 GiB, img loaded, planned img+up) runs paid job A (img
  1024x1024, 20 steps of 0.125 s) started at 10.0: 12 steps done. Its samplers
  batch continuously: A's batch has a seat for 3 more images of its join key, 8
  steps left. It holds paid C of "up", which it must load, then B1 (1 image), B2
  and B3 (2 images each), free jobs of A's batch key: 5 rows, two batches of
  img's ``max_batch`` 4, which C ahead of them keeps from joining A (a sampler
  takes joiners from the head of what it holds).
* ``slow`` (speed 0.5, vid loaded) runs free video job D, resumed at 5.0 from a
  checkpoint at half of its 30 steps (suspended once, at 4.0): its checkpoint read
  (0.5 s) and 3 steps of 2 s done, so 18 steps of 30; a suspension is asked for.
* ``small`` (speed 1, 12 GiB: no room for vid, hot at 85 C) is idle.
* Waiting: free E (img 512x512) and paid F, suspended at 9.0 (it ages from there).

Latency classes: paid has a 30 s target, image work 20 s, free and video work is
best effort: A and F are bound by 20 s, C by 30 s, the others best effort.

The tests at the end cover where the two once diverged: a resumed job's attempt,
a running batch's progress, and the GPU a failed attempt ran on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from scheduler import driver, facts
from scheduler.estimates import Durations, Learned
from scheduler.learning import durations_from
from scheduler.policy import Fleet, ModelCost
from scheduler.simulator import scenario as scenarios
from scheduler.simulator import trace as traces
from scheduler.simulator.conditions import Adapters
from scheduler.simulator.engine import Simulation
from scheduler.simulator.policies import DarkroomPolicy
from scheduler.simulator.scenario import GIB
from scheduler.simulator.trace import TraceJob
from scheduler.simulator.world import Job
from scheduler.snapshot import FleetSnapshot, Progress, Worker
from scheduler.views import job_view, running_views, worker_views
from services.db.counts import SubmittedCount
from services.db.records import AttemptFailure, HeldGroup, JobSummary, RunningJobRecord
from services.db.states import JobStatus, WorkerStatus
from services.generation import AdapterUse, BatchKey, JobShape, JoinKey
from services.seats import OpenSeat
from tests import fleets
from tests.records import new_job, summary, worker_record


def _job(model: str, size: int, steps: int, lane: str, **more: object) -> dict[str, object]:
    return {"model": model, "width": size, "height": size, "steps": steps, "lane": lane, **more}


SCENARIO = fleets.scenario(
    simulation={"duration_s": 300, "seed": 7, "idle_temperature_c": 65, "demand_window_s": 180, "resume_s": 0.5},
    darkroom={
        "backlog_limit": 0,
        "best_effort": ["video", "free"],
        "capability_targets": {"image": 20},
        "capability_caps": {"video": 1},
        "lanes": {"paid": {"priority": 10, "target_s": 30}, "free": {"priority": 0}},
    },
    models={
        "img": {**fleets.IMAGE, "step_s_512": 0.0625, "max_batch": 4},
        "vid": fleets.VIDEO,
        "up": {"capability": "upscale", "step_s_512": 0.125, "load_s": 3, "vram_gb": 6},
    },
    jobs={
        "a": _job("img", 1024, 20, "paid"),
        "b": _job("img", 1024, 20, "free"),
        "b2": _job("img", 1024, 20, "free", batch=2),
        "c": _job("up", 512, 20, "paid"),
        "d": _job("vid", 512, 30, "free"),
        "e": _job("img", 512, 20, "free"),
    },
    phases=[{"start_s": 0, "weights": {"a": 1, "b": 1, "b2": 1, "c": 1, "d": 1, "e": 1}}],
    gpus=[fleets.gpu("fast", 2.0, 24, "img"), fleets.gpu("slow", 0.5, 24, "vid"), fleets.gpu("small", 1.0, 12, "img")],
    thermal=[{"gpu": "small", "start_s": 0, "end_s": 1e12, "temperature_c": 85, "slowdown": 0.8}],
)

STYLE = "style:v1"  # E's LoRA adapter, resident on "small"
BASE = 1_800_000_000.0
NOW = BASE + 11.5
WINDOW_S = 180.0
# Job ids: the database's, and (as numbers) the simulator's.
D, F, A, B1, B2, B3, C, E, B4 = "1", "2", "3", "4", "5", "6", "7", "8", "9"

# The registry both sides price work with (production: ``costs_from(registry)``).
COSTS = {
    "img": ModelCost("image", step_s_512=0.0625, load_s=5.0, vram_bytes=10 * GIB, max_batch=4),
    "vid": ModelCost("video", step_s_512=1.0, load_s=8.0, vram_bytes=20 * GIB),
    "up": ModelCost("upscale", step_s_512=0.125, load_s=3.0, vram_bytes=6 * GIB),
}
# Learned so far, as stored (``Shape.key``: (mean, count)): img 1024x1024 20 steps
# takes 5 s alone and 16 s as a batch of 4 on a speed-1.0 GPU (true: alone, 5 s).
ESTIMATES = {"img|1048576|20|1": (5.0, 3), "img|1048576|20|4": (16.0, 3)}


def at(offset: float) -> datetime:
    return datetime.fromtimestamp(BASE + offset, UTC)


# -- the simulated world ----------------------------------------------------------


@dataclass
class Simulated:
    sim: Simulation
    policy: DarkroomPolicy
    jobs: dict[str, Job]


def scenario(tmp_path: Path) -> scenarios.Scenario:
    return fleets.load(tmp_path, SCENARIO, "facts")


def trace_jobs(sc: scenarios.Scenario) -> dict[str, TraceJob]:
    """The first job of each type in the scenario's trace (its lane, priority and
    latency target as the trace generator gives them), without noise."""
    first: dict[str, TraceJob] = {}
    for tj in traces.trace(sc, 0.5):
        first.setdefault(tj.type.name, replace(tj, work_s=sc.work_s(tj.type)))
    assert set(first) == set(sc.job_types)
    return first


def arrive(sim: Simulation, tj: TraceJob, name: str, arrival: float) -> Job:
    """``tj`` arrives at BASE + ``arrival``, as the simulation's ARRIVAL event has it."""
    tj = replace(tj, id=int(name), arrival_s=BASE + arrival)
    job = Job(tj, sim.scenario.models[tj.type.model].capability, tj.arrival_s)
    sim.jobs.append(job)
    sim.pending.append(job)
    sim.arrived.append(job)
    return job


def suspended(job: Job, *, at_s: float, done: float) -> None:
    """``job`` as the simulation leaves it once suspended (``Simulation._suspended``)
    after one attempt ran ``done`` of its steps."""
    job.attempts, job.done, job.preemptions = 1, done, 1
    job.suspended_at = BASE + at_s


def simulated(tmp_path: Path) -> Simulated:
    sc = scenario(tmp_path)
    policy = DarkroomPolicy(sc)
    assert policy.costs == COSTS
    policy.durations = Durations(shapes={k: Learned(mean, n) for k, (mean, n) in ESTIMATES.items()})
    policy.primaries = {"fast": "img", "slow": "vid"}
    sim = Simulation(sc, policy, [], load=0.5, continuous=True)
    sim.gpus["fast"].planned = frozenset({"img", "up"})
    sim.gpus["slow"].planned = frozenset({"vid"})
    sim.gpus["small"].planned = frozenset({"img"})
    t = trace_jobs(sc)
    jobs = {
        D: arrive(sim, t["d"], D, 2.0),
        F: arrive(sim, t["a"], F, 3.0),
        A: arrive(sim, t["a"], A, 9.0),
        B1: arrive(sim, t["b"], B1, 10.25),
        B2: arrive(sim, t["b2"], B2, 10.5),
        B3: arrive(sim, t["b2"], B3, 10.75),
        C: arrive(sim, t["c"], C, 10.875),
        E: arrive(sim, replace(t["e"], adapter=STYLE), E, 11.0),
    }
    sim.gpus["small"].adapters = {STYLE: BASE + 1.0}  # resident since an earlier job
    suspended(jobs[D], at_s=4.0, done=0.5)
    suspended(jobs[F], at_s=9.0, done=0.25)
    sim.assign(jobs[D], "slow", BASE + 5.0)
    sim.assign(jobs[A], "fast", BASE + 10.0)
    for name in (C, B1, B2, B3):
        sim.assign(jobs[name], "fast", BASE + 10.875)
    sim.suspend("slow", NOW)
    assert sim.gpus["fast"].running is jobs[A] and sim.gpus["slow"].running is jobs[D]
    assert [j.id for j in sim.pending] == [jobs[F].id, jobs[E].id]
    return Simulated(sim, policy, jobs)


@pytest.fixture
def sim_world(tmp_path: Path) -> Simulated:
    return simulated(tmp_path)


# -- the same state as the database holds it --------------------------------------

JOBS = {
    D: summary(
        new_job(id=D, lane="free", priority=0, model="vid", width=512, height=512, steps=30),
        status=JobStatus.RUNNING,
        attempt=2,  # scheduled twice: its first attempt, then its resumption
        worker_id="slow",
        progress_step=18,
        progress_total=30,
        created_at=at(2.0),
        scheduled_at=at(5.0),
        aged_from=at(4.0),
    ),
    F: summary(
        new_job(id=F, lane="paid", priority=10, model="img", width=1024, height=1024, steps=20),
        attempt=1,
        created_at=at(3.0),
        aged_from=at(9.0),
    ),
    A: summary(
        new_job(id=A, lane="paid", priority=10, model="img", width=1024, height=1024, steps=20),
        status=JobStatus.RUNNING,
        attempt=1,
        worker_id="fast",
        progress_step=12,
        progress_total=20,
        created_at=at(9.0),
        scheduled_at=at(10.0),
    ),
    **{
        name: summary(
            new_job(id=name, lane="free", model="img", width=1024, height=1024, steps=20, num_images=images),
            status=JobStatus.SCHEDULED,
            attempt=1,
            worker_id="fast",
            created_at=at(created),
            scheduled_at=at(10.875),
        )
        for name, images, created in ((B1, 1, 10.25), (B2, 2, 10.5), (B3, 2, 10.75))
    },
    C: summary(
        new_job(id=C, lane="paid", priority=10, model="up", width=512, height=512, steps=20),
        status=JobStatus.SCHEDULED,
        attempt=1,
        worker_id="fast",
        created_at=at(10.875),
        scheduled_at=at(10.875),
    ),
    E: summary(
        new_job(id=E, lane="free", model="img", width=512, height=512, steps=20, adapters=(AdapterUse("style", "v1"),)),
        created_at=at(11.0),
    ),
}
# What ``_HELD_GROUPS`` (services/db/repository/scheduling.py) reads of those jobs.
IMG = BatchKey("img", 1024, 1024, 20, 7.5)
IMG_SHAPE = JobShape("img", 1024, 1024, 20, 7.5, 1)
HELD = [
    HeldGroup("fast", JobStatus.RUNNING, IMG, jobs=1, images=1, largest=1, done=12 / 20),
    HeldGroup("fast", JobStatus.SCHEDULED, BatchKey("up", 512, 512, 20, 7.5), jobs=1, images=1, largest=1, done=0.0),
    HeldGroup("fast", JobStatus.SCHEDULED, IMG, jobs=3, images=5, largest=2, done=0.0),
    HeldGroup("slow", JobStatus.RUNNING, BatchKey("vid", 512, 512, 30, 7.5), jobs=1, images=1, largest=1, done=18 / 30),
]
RUNNING = [
    RunningJobRecord(A, 1, "fast", "paid", 10, IMG_SHAPE, 12, 0, False, at(10.0)),
    RunningJobRecord(D, 2, "slow", "free", 0, JobShape("vid", 512, 512, 30, 7.5, 1), 18, 1, True, at(5.0)),
]
ALL = ("img", "vid", "up")
IMG_SEAT = {"model": "img", "width": 1024, "height": 1024, "frames": 1}
WORKERS = [
    worker_record(
        "fast",
        ALL,
        warm_models=("img",),
        vram_total_bytes=24 * GIB,
        vram_used_bytes=10 * GIB,
        speed=2.0,
        temperature_c=65.0,
        planned_models=("img", "up"),
        primary_model="img",
        capabilities=("image", "upscale", "video"),
        telemetry={"open_seats": [{**IMG_SEAT, "rows": 1, "free_rows": 3, "steps_left": 8}]},
    ),
    worker_record(
        "slow",
        ALL,
        warm_models=("vid",),
        vram_total_bytes=24 * GIB,
        vram_used_bytes=20 * GIB,
        speed=0.5,
        temperature_c=65.0,
        planned_models=("vid",),
        primary_model="vid",
        capabilities=("image", "upscale", "video"),
    ),
    worker_record(
        "small",
        ("img", "up"),
        warm_models=("img",),
        vram_total_bytes=12 * GIB,
        vram_used_bytes=10 * GIB,
        speed=1.0,
        temperature_c=85.0,
        planned_models=("img",),
        capabilities=("image", "upscale"),
        # As the simulated world has its adapters: loaded in the scenario's time.
        telemetry={"adapters": [STYLE], "adapter_load_s": Adapters().load_s},
    ),
]


def production_fleet() -> Fleet:
    return Fleet(COSTS, durations_from(ESTIMATES, {}))


# -- checks -----------------------------------------------------------------------


def production(now: float = NOW, **records: Any) -> FleetSnapshot:
    return facts.fleet_snapshot(datetime.fromtimestamp(now, UTC), **records)


def simulated_snapshot(world: Simulated) -> FleetSnapshot:
    fleet = world.policy.facts.fleet_snapshot(world.sim, NOW, world.policy.primaries)
    return replace(fleet, running=tuple(world.policy.facts.running(world.sim, NOW)))


def progress_free(items: Sequence[Any]) -> list[Any]:
    return [replace(i, progress=Progress()) for i in items]


def exercised(items: Sequence[Any], *, but: tuple[str, ...] = ()) -> None:
    """Every defaulted field of the facts' type (``but`` those named) is off its
    default in some fact: the state exercises it, so a filler that dropped it
    could not agree with one that did not."""
    kind = type(items[0])
    for f in fields(kind):
        if f.name in but:
            continue
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            continue  # no default: always given
        assert any(getattr(i, f.name) != default for i in items), f"no {kind.__name__} sets {f.name}"


def test_queued_jobs_are_the_same(sim_world: Simulated) -> None:
    simulated = [sim_world.policy.facts.queued_job(job) for job in sim_world.jobs.values()]
    produced = [facts.queued_job(JOBS[name]) for name in sim_world.jobs]
    assert simulated == produced
    # guidance_scale: the simulator has none; failed_on: see test_a_job_whose_gpu_failed_avoids_it_in_both.
    exercised(produced, but=("failed_on",))
    views = [job_view(j, sim_world.sim.scenario.darkroom, COSTS) for j in produced]
    assert {v.id: v.target_s for v in views} == {A: 20, F: 20, C: 30, B1: None, B2: None, B3: None, D: None, E: None}
    assert {v.id: v.queued_at for v in views if v.id in (D, F, E)} == {D: BASE + 4.0, F: BASE + 9.0, E: BASE + 11.0}


def test_workers_and_what_they_hold_are_the_same(sim_world: Simulated) -> None:
    simulated = simulated_snapshot(sim_world)
    produced = production(workers=WORKERS, held=HELD, running=RUNNING)
    assert simulated.workers == produced.workers
    assert [w.id for w in produced.workers] == ["fast", "slow", "small"]
    # gpus: a group's, in tests/unit/test_group_placement.py.
    exercised(produced.workers, but=("state", "loading_s", "measured", "gpus"))
    seat = OpenSeat(JoinKey("img", 1024, 1024), rows=1, free_rows=3, steps_left=8)
    assert [w.open_seats for w in simulated.workers] == [(seat,), (), ()]
    assert progress_free(simulated.held) == progress_free(produced.held)
    # fast: A's 1 s left, C's model load 3 s, the batches of 4 (8 s) and 1 (2.5 s)
    # of B1-B3, C's 1.25 s; slow: 12 steps of 2 s.
    views = worker_views(produced, production_fleet())
    assert [v.held_jobs for v in views] == [4, 1, 0]
    assert [v.held_work_s for v in views] == pytest.approx([15.75, 24.0, 0.0], abs=1e-9)
    assert [v.held_work_s for v in worker_views(simulated, production_fleet())] == pytest.approx(
        [15.75, 24.0, 0.0], abs=1e-9
    )


def test_running_jobs_are_the_same(sim_world: Simulated) -> None:
    simulated = simulated_snapshot(sim_world)
    produced = production(workers=WORKERS, held=HELD, running=RUNNING)
    assert progress_free(simulated.running) == progress_free(produced.running)
    exercised(produced.running, but=("progress",))
    config = sim_world.sim.scenario.darkroom
    for fleet in (simulated, produced):
        views = running_views(fleet, production_fleet(), config)
        assert [(v.job_id, v.step_s, v.remaining_s) for v in views] == [
            (A, pytest.approx(0.125), pytest.approx(1.0)),
            (D, pytest.approx(2.0), pytest.approx(24.0)),
        ]


def submitted_counts(jobs: Mapping[str, JobSummary]) -> list[SubmittedCount]:
    """The planner's demand query over ``jobs``, all submitted within the window."""
    counts: dict[tuple[str, int, int, int, int, str, bool], int] = {}
    for j in jobs.values():
        newer = j.created_at.timestamp() >= NOW - WINDOW_S / 2
        key = (j.shape.model, j.shape.width, j.shape.height, j.shape.steps, j.shape.num_images, j.lane, newer)
        counts[key] = counts.get(key, 0) + 1
    return [SubmittedCount(*key, count=n) for key, n in sorted(counts.items())]


def test_demand_is_the_same(sim_world: Simulated) -> None:
    """The simulator counts each job it saw arrive in the window; production
    counts them by shape and lane: the same demand, and the same warm sets."""
    sim = sim_world.sim
    simulated = [sim_world.policy.facts.submitted(j, newer=j.queued_at >= NOW - WINDOW_S / 2) for j in sim.arrived]
    produced = production(workers=WORKERS, submitted_counts=submitted_counts(JOBS))
    assert Counter(replace(s, count=1) for s in simulated) == Counter(
        {replace(s, count=1): s.count for s in produced.submitted}
    )
    config = sim.scenario.darkroom
    durations = production_fleet().durations
    simulated_fleet = FleetSnapshot(NOW, workers=simulated_snapshot(sim_world).workers, submitted=tuple(simulated))
    assert driver.plan_warm(simulated_fleet, COSTS, durations, config, window_s=WINDOW_S) == driver.plan_warm(
        produced, COSTS, durations, config, window_s=WINDOW_S
    )


# -- where the two once diverged ------------------------------------------------------


def test_a_resumed_job_s_attempt_counts_alike(sim_world: Simulated) -> None:
    [simulated] = [r for r in simulated_snapshot(sim_world).running if r.id == D]
    [produced] = [r for r in production(running=RUNNING).running if r.id == D]
    assert simulated.attempt == produced.attempt == 2


def batch_running(tmp_path: Path) -> tuple[Simulated, list[RunningJobRecord]]:
    """B1 and another one-image job of its key started together on fast at 10.0,
    each 12 steps of 20 done at NOW (a batch of 2 takes 5 s at speed 2: steps of 0.25 s;
    NOW is 1.5 s in: 6 steps). Nothing else runs."""
    sc = scenario(tmp_path)
    policy = DarkroomPolicy(sc)
    policy.durations = Durations(shapes={k: Learned(mean, n) for k, (mean, n) in ESTIMATES.items()})
    sim = Simulation(sc, policy, [], load=0.5)
    t = trace_jobs(sc)
    first, second = arrive(sim, t["b"], B1, 9.0), arrive(sim, t["b"], B4, 9.5)
    # Both queued before fast looks, as a pass's placements arrive together.
    sim.pending.remove(first)
    sim.gpus["fast"].queue.append(first)
    sim.assign(second, "fast", BASE + 10.0)
    assert sim.gpus["fast"].batch == [first, second]
    running = [
        RunningJobRecord(str(j.id), 1, "fast", "free", 0, IMG_SHAPE, 6, 0, False, at(10.0)) for j in (first, second)
    ]
    return Simulated(sim, policy, {B1: first, B4: second}), running


def test_a_running_batch_holds_its_worker_and_is_estimated_alike(tmp_path: Path) -> None:
    world, running = batch_running(tmp_path)
    held = [HeldGroup("fast", JobStatus.RUNNING, BatchKey("img", 1024, 1024, 20, 7.5), 2, 2, 1, 6 / 20)]
    simulated, produced = simulated_snapshot(world), production(workers=WORKERS, held=held, running=running)
    [fast, *_] = worker_views(produced, production_fleet())
    [simulated_fast, *_] = worker_views(simulated, production_fleet())
    assert (fast.held_work_s, fast.held_jobs) == (pytest.approx(simulated_fast.held_work_s, abs=1e-9), 1)
    assert fast.held_work_s == pytest.approx(3.5)
    # A step of the batch of 2 (0.25 s), 3.5 s left of it, for each of its jobs.
    config = world.sim.scenario.darkroom
    for views in (
        running_views(simulated, production_fleet(), config),
        running_views(produced, production_fleet(), config),
    ):
        assert [(v.step_s, v.remaining_s) for v in views] == [pytest.approx((0.25, 3.5))] * 2


def test_a_job_retried_after_its_gpu_failed_runs_as_the_same_attempt(sim_world: Simulated) -> None:
    """fast fails at NOW while running A (its first attempt); A starts again on small."""
    sim = sim_world.sim
    sim._fail("fast", NOW)
    sim.assign(sim_world.jobs[A], "small", NOW)
    [simulated] = [r for r in sim_world.policy.facts.running(sim, NOW) if r.worker_id == "small"]
    retried = RunningJobRecord(A, 2, "small", "paid", 10, IMG_SHAPE, 0, 0, False, at(11.5))
    [produced] = production(running=[retried]).running
    assert replace(simulated, progress=Progress()) == replace(produced, progress=Progress())
    assert simulated.attempt == 2


def test_a_job_whose_gpu_failed_avoids_it_in_both(sim_world: Simulated) -> None:
    sim_world.sim._fail("fast", NOW)
    lost = replace(JOBS[A], status=JobStatus.QUEUED, worker_id=None, attempt_log=(AttemptFailure(1, "fast", "lost"),))
    produced = facts.queued_job(lost)
    assert produced.failed_on == frozenset({"fast"})
    assert sim_world.policy.facts.queued_job(sim_world.jobs[A]).failed_on == produced.failed_on


def test_a_pass_reads_the_jobs_of_served_models_and_of_capabilities_none_serves() -> None:
    costs = {
        "sd": ModelCost("image", step_s_512=0.05, load_s=8.0, vram_bytes=1),
        "xl": ModelCost("image", step_s_512=0.1, load_s=12.0, vram_bytes=1),
        "vid": ModelCost("video", step_s_512=0.5, load_s=30.0, vram_bytes=1),
    }

    def sampler(wid: str, models: set[str], state: WorkerStatus = WorkerStatus.READY) -> Worker:
        return Worker(wid, state, frozenset(models), frozenset(), 0, 0, 1.0, 0.0, frozenset())

    # xl: no live sampler serves it, but image work is served: its backlog stays out of sight.
    assert facts.window_models([sampler("a", {"sd"})], costs) == ["sd", "vid"]
    # A draining sampler serves nothing; none at all: every job is read (and told what it waits for).
    assert facts.window_models([sampler("a", {"sd", "xl", "vid"}, WorkerStatus.DRAINING)], costs) == ["sd", "vid", "xl"]
    assert facts.window_models([], costs) == ["sd", "vid", "xl"]
