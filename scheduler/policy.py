"""The placement policy's views and arithmetic: what a job, a worker and a model
cost are to the policy (built from a fleet snapshot by ``scheduler.views``), how
long work takes on a worker from the learned durations, and the order the queue is
placed in. Pure: frozen values in, numbers out; ``scheduler.placement`` decides
with them."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from scheduler.estimates import Durations, Shape
from services.config.placement import PlacementSettings
from services.db.states import WorkerStatus
from services.generation import BatchKey, JoinKey
from services.seats import OpenSeat


@dataclass(frozen=True)
class ModelCost:
    capability: str  # what kind of work it is ("image", "video"); caps apply per capability
    step_s_512: float  # first estimate: one step of one 512x512 image on a speed-1.0 worker
    load_s: float
    vram_bytes: int
    eviction_priority: int = 0  # lower is evicted first
    max_batch: int = 1  # images one batch may hold
    # GPUs one replica spans where a group of that size serves it (registry ``parallel``);
    # a single GPU runs it unsplit.
    parallel_size: int = 1


@dataclass(frozen=True)
class JobView:
    id: str
    model: str
    width: int
    height: int
    steps: int
    num_images: int
    priority: int = 0
    queued_at: float = 0.0  # seconds on the caller's clock
    guidance_scale: float = 7.5
    # Workers where an attempt of it failed: it goes elsewhere if anywhere else can take it.
    failed_on: frozenset[str] = frozenset()
    # Its latency target (``PlacementSettings.target_s`` of its lane and capability);
    # None: best effort.
    target_s: float | None = None
    lane: str = ""
    tenant: str = ""
    frames: int = 1  # of each output: a video's, 1 for an image
    adapters: frozenset[str] = frozenset()  # its LoRA adapters' NAME:VERSION

    @property
    def pixels(self) -> int:
        return self.width * self.height * self.frames

    @cached_property  # placement asks for it once for each worker a job is scored on
    def shape(self) -> Shape:
        return Shape(self.model, self.pixels, self.steps, self.num_images)

    @cached_property  # placement asks for it once for each worker a job is scored on
    def batch_key(self) -> BatchKey:
        return BatchKey(self.model, self.width, self.height, self.steps, self.guidance_scale, self.frames)

    @cached_property  # placement asks for it once for each worker a job is scored on
    def join_key(self) -> JoinKey:
        return JoinKey(self.model, self.width, self.height, self.frames)


@dataclass(frozen=True)
class WorkerView:
    id: str
    models: frozenset[str]  # models it can serve
    warm_models: frozenset[str]
    vram_total_bytes: int  # 0: unknown (a CPU worker), treated as unlimited
    vram_used_bytes: int
    speed: float = 1.0  # declared; the learned speed in Durations wins once known
    held_jobs: int = 0  # jobs given to it and not finished
    held_work_s: float = 0.0  # estimated seconds until it has done them
    held_capabilities: frozenset[str] = frozenset()
    temperature_c: float = 0.0
    state: WorkerStatus = WorkerStatus.READY
    planned_models: frozenset[str] = frozenset()  # the warm set the planner wants here
    # Images of jobs it holds but has not started, per batch key: batches still open.
    open_batches: tuple[tuple[BatchKey, int], ...] = ()
    # The kinds of work it serves ("image", "video", "upscale"); None: its models'.
    capabilities: frozenset[str] | None = None
    # Room in the batch it runs now: a job of a seat's join key joins at the next step.
    open_seats: tuple[OpenSeat, ...] = ()
    # The LoRA adapters resident on its device, and what loading another costs it.
    adapters: frozenset[str] = frozenset()
    adapter_load_s: float = 0.0
    # Its devices: more than one for a group, which spans the models of that size.
    gpus: int = 1

    def spans(self, cost: ModelCost) -> bool:
        """Whether a job of a model of ``cost`` runs across its devices here."""
        return self.gpus > 1 and cost.parallel_size == self.gpus

    def adapters_missing(self, job: JobView) -> frozenset[str]:
        """``job``'s adapters this worker would load first."""
        return job.adapters - self.adapters if job.adapters else frozenset()

    def adapter_seconds(self, job: JobView) -> float:
        """What loading ``job``'s adapters it lacks costs it before the job's first step."""
        return len(self.adapters_missing(job)) * self.adapter_load_s

    def serves(self, capability: str) -> bool:
        return self.capabilities is None or capability in self.capabilities

    def open_rows(self, key: BatchKey) -> int:
        return dict(self.open_batches).get(key, 0)

    def batches_with(self, key: BatchKey, rows: int) -> tuple[tuple[BatchKey, int], ...]:
        """Its open batches, ``key``'s now of ``rows`` images."""
        return tuple(sorted({**dict(self.open_batches), key: rows}.items()))

    def seat_for(self, key: JoinKey, images: int) -> OpenSeat | None:
        """The seat a job of ``key`` and ``images`` images takes here, if any has room."""
        return next((s for s in self.open_seats if s.takes(key, images)), None)

    def seats_with(self, taken: OpenSeat, now: OpenSeat) -> tuple[OpenSeat, ...]:
        """Its open seats, ``taken`` now ``now``."""
        return tuple(now if s == taken else s for s in self.open_seats)


class PlacementKind(enum.StrEnum):
    """What a worker has to do to take a job."""

    WARM = "warm"  # its model is loaded there
    COLD = "cold"  # it loads the model first
    BATCH = "batch"  # it joins a batch the worker holds
    SEAT = "seat"  # it joins the batch the worker runs, at its next step


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    eligible: bool
    finish_s: float  # estimated seconds from now until the job would be done there
    note: str
    has_room: bool = True  # its backlog can take the job now
    kind: PlacementKind | None = None  # what taking the job means there (None: not eligible)


@dataclass(frozen=True)
class Placement:
    job_id: str
    worker_id: str | None  # None: it stays queued
    reason: str
    candidates: tuple[Candidate, ...]
    reserved_on: str | None = None  # the worker it waits for, when it waits for one
    waiting_for: str = ""  # the capability no live sampler serves, when that is why it waits


@dataclass(frozen=True)
class Fleet:
    """What a pass knows besides the workers: costs, learned durations, and which
    capabilities have work waiting."""

    costs: Mapping[str, ModelCost]
    durations: Durations = field(default_factory=Durations)
    waiting: Mapping[str, int] = field(default_factory=dict)  # capability -> jobs queued
    busy: Mapping[str, int] = field(default_factory=dict)  # capability -> GPUs holding such work
    wanted: Mapping[str, int] = field(default_factory=dict)  # model -> jobs queued for it
    warm: Mapping[str, int] = field(default_factory=dict)  # model -> workers that have it loaded
    planned: Mapping[str, int] = field(default_factory=dict)  # model -> live workers planned to keep it
    adapter_load_s: float = 0.5  # a LoRA adapter's load, on a worker that has not measured its own


def thermal_factor(temperature_c: float, config: PlacementSettings) -> float:
    return 1.0 + max(0.0, temperature_c - config.hot_c) / config.hot_span_c


# What a group's first estimate assumes of each device it spans, before its own
# speed is learned: Ulysses' and the halves' collectives cost about a fifth
# (xDiT's Flux.1-dev on 4 H100: 2.6x, on 2: 1.7x).
GROUP_EFFICIENCY = 0.8


def speed_id(worker: WorkerView, cost: ModelCost) -> tuple[str, float]:
    """Whose learned speed a job of ``cost``'s model runs at on ``worker``, and the
    speed declared before any is learned: a group's spanning jobs are learned apart
    from the jobs its leader runs alone (``{id}@span``), from a first guess of
    ``GROUP_EFFICIENCY`` per device."""
    if worker.spans(cost):
        return f"{worker.id}@span", worker.speed * worker.gpus * GROUP_EFFICIENCY
    return worker.id, worker.speed


def worker_speed(job: JobView, worker: WorkerView, fleet: Fleet) -> float:
    """``worker``'s speed for ``job``, as learned (``speed_id``)."""
    key, declared = speed_id(worker, fleet.costs[job.model])
    return fleet.durations.speed(key, declared)


def job_seconds(job: JobView, worker: WorkerView, fleet: Fleet) -> float:
    cost = fleet.costs[job.model]
    return fleet.durations.shape_seconds(job.shape, cost.step_s_512) / worker_speed(job, worker, fleet)


def gpu_seconds(job: JobView, fleet: Fleet) -> float:
    """What ``job`` costs a GPU of speed 1, as learned (0 for a model without a cost)."""
    cost = fleet.costs.get(job.model)
    return fleet.durations.shape_seconds(job.shape, cost.step_s_512) if cost is not None else 0.0


def batch_seconds(job: JobView, rows: int, worker: WorkerView, fleet: Fleet) -> float:
    """How long a batch of ``rows`` images of ``job``'s key takes on ``worker``."""
    cost = fleet.costs[job.model]
    shape = Shape(job.model, job.pixels, job.steps, rows)
    return fleet.durations.shape_seconds(shape, cost.step_s_512) / worker_speed(job, worker, fleet)


def queued_batches(job: JobView, rows: int, worker: WorkerView, fleet: Fleet) -> tuple[int, float]:
    """How many batches ``rows`` queued images of ``job``'s key make on ``worker``
    (of the model's batch size; a job bigger than that runs alone), and their time."""
    per_batch = max(fleet.costs[job.model].max_batch, job.num_images)
    full, rest = divmod(rows, per_batch)
    seconds = full * batch_seconds(job, per_batch, worker, fleet) if full else 0.0
    if rest:
        seconds += batch_seconds(job, rest, worker, fleet)
    return full + (1 if rest else 0), seconds


def joining_seconds(job: JobView, worker: WorkerView, fleet: Fleet) -> float | None:
    """What ``job`` adds to ``worker`` by joining a batch it holds open, if it can:
    the batch's growth, when that costs no more than running the job alone."""
    rows = worker.open_rows(job.batch_key)
    if not rows or rows + job.num_images > fleet.costs[job.model].max_batch:
        return None
    growth = batch_seconds(job, rows + job.num_images, worker, fleet) - batch_seconds(job, rows, worker, fleet)
    return max(growth, 0.0) if growth <= job_seconds(job, worker, fleet) else None


def step_seconds(job: JobView, rows: int, worker: WorkerView, fleet: Fleet) -> float:
    """One step of a batch of ``rows`` images of ``job``'s join key on ``worker``."""
    durations = fleet.durations
    step_s = durations.step_seconds(job.model, job.pixels, rows, fleet.costs[job.model].step_s_512)
    return step_s / worker_speed(job, worker, fleet)


@dataclass(frozen=True)
class SeatJoin:
    """``job`` joining the batch ``worker`` runs, at its next step boundary."""

    seat: OpenSeat  # the seat it takes, as it was
    finish_s: float  # from now until the job is done
    growth_s: float  # what the worker's held work grows by


def seat_join(job: JobView, worker: WorkerView, fleet: Fleet) -> SeatJoin | None:
    """What taking an open seat on ``worker`` means for ``job``, if one takes it.
    It waits for the step under way (counted whole: the heartbeat is not that
    fresh), then runs its own steps at the bigger batch's step time (members
    leaving as they finish only speed it up). The batch's other members slow by
    the bigger step while they share it; a joiner with more steps than the batch
    has left runs on alone after they leave, which the worker's work grows by too."""
    seat = worker.seat_for(job.join_key, job.num_images)
    if seat is None:
        return None
    step_now = step_seconds(job, seat.rows, worker, fleet)
    step_with = step_seconds(job, seat.rows + job.num_images, worker, fleet)
    shared = min(job.steps, seat.steps_left)
    growth = shared * max(step_with - step_now, 0.0)
    if job.steps > seat.steps_left:
        growth += (job.steps - seat.steps_left) * step_seconds(job, job.num_images, worker, fleet)
    return SeatJoin(seat, step_now + job.steps * step_with, growth)


def effective_priority(job: JobView, config: PlacementSettings, *, now: float) -> float:
    return job.priority + config.aging_per_s * max(0.0, now - job.queued_at)


def queue_key(job: JobView, config: PlacementSettings, *, now: float) -> tuple[int, float, float, str]:
    """Latency-bound work first, earliest deadline (submit plus target) first, so
    a job with a looser target overtakes a tighter one only once its own deadline
    comes sooner; then best-effort work, highest lane first, older first within a
    lane, and aging across lanes."""
    if job.target_s is not None:
        return (0, job.queued_at + job.target_s, job.queued_at, job.id)
    return (1, -effective_priority(job, config, now=now), job.queued_at, job.id)


def order_queue(jobs: Sequence[JobView], config: PlacementSettings, *, now: float) -> list[JobView]:
    """The order a pass places jobs in: see ``queue_key``."""
    return sorted(jobs, key=lambda j: queue_key(j, config, now=now))
