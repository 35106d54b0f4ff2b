"""The simulated world's things: a job as it goes through the simulator, a GPU
with what it has loaded, queued and running, and a run's result. What a placement
policy must answer to be simulated is ``fleet.Policy``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.simulator.scenario import GIB, SimGpu
from scheduler.simulator.trace import TraceJob


@dataclass
class Job:
    trace: TraceJob
    capability: str
    queued_at: float
    start_s: float | None = None
    finish_s: float | None = None
    cold: bool = False
    attempts: int = 0
    gpu: str | None = None
    # Suspension: the share of its steps done (kept across suspensions), the share
    # done when its current run began, and how often it was suspended.
    done: float = 0.0
    resumed_from: float = 0.0
    preemptions: int = 0
    suspend_requested: bool = False
    suspended_at: float | None = None  # its latest suspension
    # GPUs that failed while running it, as production's attempt log records them.
    failed_on: frozenset[str] = frozenset()
    joined: bool = False  # it joined a batch already running (continuous batching)

    @property
    def id(self) -> int:
        return self.trace.id

    @property
    def model(self) -> str:
        return self.trace.type.model


@dataclass
class Member:
    """A job in a batch that others join at step boundaries (continuous batching)."""

    job: Job
    steps_left: int  # at the batch's latest boundary
    stepping: bool  # False: offered, it joins at the next boundary
    joined_at: float = 0.0  # when it began stepping
    # Its steps so far and their images, summed: the batch's mean size it ran in.
    steps_run: int = 0
    row_steps: int = 0


@dataclass
class SteppedBatch:
    """A GPU's running batch under continuous batching: it steps from ``since``
    (its latest boundary, or when its compute begins) at ``step_s`` a step while
    its members stay as they are."""

    members: list[Member]
    max_rows: int  # the model's max_batch
    since: float
    step_s: float = 0.0

    @property
    def rows(self) -> int:
        return sum(m.job.trace.type.batch for m in self.members)


@dataclass
class Gpu:
    spec: SimGpu
    vram_total: int
    up: bool = True
    loaded: dict[str, float] = field(default_factory=dict)  # model -> last used
    adapters: dict[str, float] = field(default_factory=dict)  # resident LoRA adapter -> last used
    queue: deque[Job] = field(default_factory=deque)
    running: Job | None = None
    riders: list[Job] = field(default_factory=list)  # the rest of the running batch
    stepped: SteppedBatch | None = None  # the running batch, when jobs join it at its steps
    running_since: float = 0.0
    run_s: float = 0.0  # how long the running batch takes, its load included
    run_load_s: float = 0.0  # the load part of it
    run_resume_s: float = 0.0  # the part reading a resumed job's checkpoint back
    busy_until: float = 0.0
    preloading: str | None = None
    planned: frozenset[str] = frozenset()
    busy_s: float = 0.0
    # Bumped when its pending event no longer holds (it failed, a batch suspends or
    # changes): events of an earlier generation are dropped.
    generation: int = 0

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def idle(self) -> bool:
        return self.up and self.running is None and self.preloading is None

    @property
    def held(self) -> int:
        return len(self.queue) + (1 + len(self.riders) if self.running is not None else 0)

    @property
    def batch(self) -> list[Job]:
        return [self.running, *self.riders] if self.running is not None else []

    def vram_used(self, costs_gb: dict[str, float]) -> int:
        return int(sum(costs_gb[m] for m in self.loaded) * GIB)


@dataclass
class Result:
    policy: str
    load: float
    jobs: list[Job]
    makespan_s: float
    cold_loads: int
    preloads: int
    busy_s: float
    up_s: float
    overloaded: bool
    suspensions: int = 0
    adapter_loads: int = 0
