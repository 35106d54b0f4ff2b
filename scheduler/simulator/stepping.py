"""GPUs that run batches step by step, in one of two ways, to compare them
(issue 35; ``bench/continuous_batching.py``):

- batch-at-start, as Darkroom's samplers run today: a GPU that frees takes the
  oldest queued job and the later ones of its batch key (model, size and steps,
  as ``services.generation.BatchKey`` has them) up to the model's ``max_batch``
  images, and runs them to the end; nothing joins a running batch.
- continuous: the batch is open at every step boundary. Queued jobs that can
  share its network call (model and size; any steps, as ``JoinKey`` has it) join
  up to ``max_batch`` images, and a member leaves when its own steps are done (its
  image is then finished) while the rest go on.

A step of a batch of k images takes the model's 512 px step time, scaled by the
pixels, times its batch factor at k (the scenario's curve), over the GPU's speed;
a job's time comes from its steps alone (the trace's per-job noise is not used).

Placement is a central FIFO queue: an arriving job starts at once on an idle GPU
(the fastest, then the first), else waits; each GPU takes from the queue when it
frees and, continuous, at each boundary of its batch while it has a seat, so a
job goes wherever room for it opens first. Darkroom's placement does not see open
seats yet, so they are modelled here rather than through ``policies``. Everything
else the event engine models (loads, failures, heat, lanes, preemption) is left
out: each model is warm on every GPU, and jobs are served oldest first.

The same scenario and trace give the same result, whatever the hash seed."""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from scheduler.estimates import REFERENCE_PIXELS
from scheduler.simulator.scenario import Scenario, SimGpu
from scheduler.simulator.trace import TraceJob


class Mode(enum.StrEnum):
    AT_START = "batch-at-start"
    CONTINUOUS = "continuous"


@dataclass(frozen=True)
class Finished:
    """A job's image, done."""

    job: int
    arrival_s: float
    start_s: float
    finish_s: float
    images: int
    gpu: str
    joined: bool  # it joined a batch that was already running

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True)
class StepRun:
    mode: Mode
    finished: tuple[Finished, ...]
    makespan_s: float  # until the last image was done
    busy_s: float  # GPU-seconds spent stepping, over all GPUs
    gpus: int


@dataclass
class _Member:
    job: TraceJob
    start_s: float
    steps_left: int
    joined: bool


@dataclass
class _Gpu:
    spec: SimGpu
    members: list[_Member] = field(default_factory=list)
    key: Hashable = None  # the running batch's key; None: idle


# At one instant, arrivals first: a job arriving as a batch reaches a boundary may join it.
ARRIVAL, BOUNDARY = range(2)


def batch_key(job: TraceJob, mode: Mode) -> Hashable:
    """What jobs must share to run in one batch: continuous batching lets steps differ."""
    t = job.type
    return (t.model, t.width, t.height) if mode is Mode.CONTINUOUS else (t.model, t.width, t.height, t.steps)


def step_s(scenario: Scenario, job: TraceJob, images: int, speed: float) -> float:
    """One step of a batch of ``images`` images of ``job``'s model and size."""
    model = scenario.models[job.type.model]
    pixels = job.type.width * job.type.height / REFERENCE_PIXELS
    return model.step_s_512 * pixels * model.batch_factor(images) / speed


class _Run:
    def __init__(self, scenario: Scenario, jobs: Sequence[TraceJob], mode: Mode) -> None:
        self.scenario, self.mode = scenario, mode
        # Fastest first, then in the scenario's order: where an idle choice goes.
        self.gpus = sorted((_Gpu(g) for g in scenario.gpus), key=lambda g: -g.spec.speed)
        self.queues: dict[Hashable, deque[TraceJob]] = {}  # by batch key, each oldest first
        self.events: list[tuple[float, int, int, int]] = []  # time, kind, order, job id or GPU index
        self.jobs = {j.id: j for j in jobs}
        self.finished: list[Finished] = []
        self.busy_s = 0.0
        for job in jobs:
            self.events.append((job.arrival_s, ARRIVAL, job.id, job.id))
        heapq.heapify(self.events)
        self._order = len(jobs)

    def run(self) -> StepRun:
        now = 0.0
        while self.events:
            now, kind, _, which = heapq.heappop(self.events)
            if kind == ARRIVAL:
                job = self.jobs[which]
                self.queues.setdefault(batch_key(job, self.mode), deque()).append(job)
                if self.events and self.events[0][:2] == (now, ARRIVAL):
                    continue  # jobs that arrive together start together, as one pass's dispatches do
                for gpu in self.gpus:
                    if gpu.key is None:  # idle: it starts a batch if anything is queued
                        self._boundary(gpu, now)
            else:
                self._boundary(self.gpus[which], now, stepped=True)
        return StepRun(self.mode, tuple(self.finished), now, self.busy_s, len(self.gpus))

    def _boundary(self, gpu: _Gpu, now: float, *, stepped: bool = False) -> None:
        """``gpu``'s batch reached a step boundary (or ``gpu`` is idle and may start
        one): who is done leaves, who may join joins, and the next steps start."""
        if stepped:
            staying = []
            for m in gpu.members:
                if m.steps_left:
                    staying.append(m)
                else:
                    self.finished.append(
                        Finished(m.job.id, m.job.arrival_s, m.start_s, now, m.job.type.batch, gpu.spec.id, m.joined)
                    )
            gpu.members = staying
        if not gpu.members:
            gpu.key = self._oldest_key()
        if gpu.key is None:
            return
        if not gpu.members or self.mode is Mode.CONTINUOUS:
            self._take(gpu, now)
        self._step(gpu, now)

    def _oldest_key(self) -> Hashable:
        heads = [(q[0].arrival_s, q[0].id, key) for key, q in self.queues.items() if q]
        return min(heads, key=lambda h: h[:2])[2] if heads else None

    def _take(self, gpu: _Gpu, now: float) -> None:
        """Queued jobs of the batch's key, oldest first, while they fit in its seats
        (the first of a new batch whatever its images)."""
        queue = self.queues.get(gpu.key)
        joining = bool(gpu.members)
        while queue and (not gpu.members or self._images(gpu) + queue[0].type.batch <= self._max_batch(gpu)):
            job = queue.popleft()
            gpu.members.append(_Member(job, now, job.type.steps, joining))

    def _step(self, gpu: _Gpu, now: float) -> None:
        """Runs steps up to the next boundary where the batch may change: at
        batch-at-start its end (every member holds its seat until the longest is
        done); continuous, the next step while a seat is open, else the first
        member's last step."""
        if self.mode is Mode.AT_START:
            steps = max(m.steps_left for m in gpu.members)
        else:
            full = self._images(gpu) >= self._max_batch(gpu)
            steps = min(m.steps_left for m in gpu.members) if full else 1
        for m in gpu.members:
            m.steps_left = max(m.steps_left - steps, 0)
        run_s = steps * step_s(self.scenario, gpu.members[0].job, self._images(gpu), gpu.spec.speed)
        self.busy_s += run_s
        self._order += 1
        heapq.heappush(self.events, (now + run_s, BOUNDARY, self._order, self.gpus.index(gpu)))

    def _max_batch(self, gpu: _Gpu) -> int:
        return self.scenario.models[gpu.members[0].job.type.model].max_batch

    @staticmethod
    def _images(gpu: _Gpu) -> int:
        return sum(m.job.type.batch for m in gpu.members)


def simulate(scenario: Scenario, jobs: Sequence[TraceJob], mode: Mode) -> StepRun:
    """Every job of the trace through the scenario's GPUs, batched the ``mode`` way."""
    return _Run(scenario, jobs, mode).run()
