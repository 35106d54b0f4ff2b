"""The fleet as plain facts at one instant: what the placement pass, the warm-set
planner and preemption decide from, and nothing else. No estimate lives here:
the driver (``scheduler.driver``) turns facts into the policy's views with the
learned durations. Production fills a snapshot from its records
(``scheduler.facts``), the simulator from its world (``scheduler.simulator.facts``),
so both decide with the same code from the same kind of picture.

Times are seconds on the caller's clock (``now`` and ``queued_at`` alike)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.db.counts import SubmittedCount
from services.db.records import JobRecord
from services.db.states import WorkerStatus
from services.db.worker_records import DeadWorker
from services.generation import BatchKey, JobShape
from services.seats import OpenSeat


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting to be placed."""

    id: str
    shape: JobShape
    lane: str
    priority: int
    queued_at: float  # its priority ages from here: its submit, or its latest suspension
    failed_on: frozenset[str] = frozenset()  # workers where an attempt of it failed
    tenant: str = ""
    adapters: frozenset[str] = frozenset()  # its LoRA adapters' NAME:VERSION


@dataclass(frozen=True)
class Progress:
    """How far work under way is: ``done`` of its steps when last seen, ``elapsed_s``
    ago, with ``pending_s`` of other work (a model load, a checkpoint read) still
    between it and its next step at that moment. Production sees progress as
    written (elapsed 0); the simulator knows when a run began."""

    done: float = 0.0
    elapsed_s: float = 0.0
    pending_s: float = 0.0


class Holding(enum.StrEnum):
    """What held work is to its worker."""

    RUNNING = "running"  # the batch it samples now
    WAITING = "waiting"  # jobs waiting to start there, open to more of their key
    RESUMING = "resuming"  # a job waiting to resume part of the way through, which runs alone
    DECODING = "decoding"  # sampled: the GPU is free of it, but its model is in use


@dataclass(frozen=True)
class HeldWork:
    """Jobs of one batch key a worker holds, in one way (``Holding``)."""

    worker_id: str
    key: BatchKey
    images: int
    largest: int  # images of its largest job
    holding: Holding
    progress: Progress = Progress()


@dataclass(frozen=True)
class Worker:
    """A live sampler."""

    id: str
    state: WorkerStatus
    models: frozenset[str]  # it can serve
    warm_models: frozenset[str]
    vram_total_bytes: int  # 0: unknown (a CPU), unlimited
    vram_used_bytes: int
    speed: float  # declared; the learned speed wins once known
    temperature_c: float
    planned_models: frozenset[str]
    primary_model: str | None = None
    loading_s: float = 0.0  # until a model it loads for its warm plan is in
    # (model, bytes, load seconds) of the models it measured as it loaded them.
    measured: tuple[tuple[str, int, float], ...] = ()
    # The kinds of work it serves; None: its models'.
    capabilities: frozenset[str] | None = None
    # Room in the batch it runs now, as its last heartbeat said.
    open_seats: tuple[OpenSeat, ...] = ()
    # The LoRA adapters resident on its device (NAME:VERSION), and the seconds it
    # measured loading one (0: not yet measured), as its last heartbeat said.
    adapters: frozenset[str] = frozenset()
    adapter_load_s: float = 0.0
    # Its devices: a group's, as its heartbeat says (``telemetry.group.size``); else 1.
    gpus: int = 1


@dataclass(frozen=True)
class RunningJob:
    """A job running on a worker, with its batch's progress."""

    id: str
    attempt: int
    worker_id: str
    lane: str
    shape: JobShape
    preemptions: int  # times suspended for other work
    suspend_requested: bool
    progress: Progress = Progress()


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's share of the GPUs: its weight, and the GPU-seconds its jobs used,
    decayed to ``at`` (``scheduler.fair_share`` decays them on to any later time)."""

    tenant: str
    weight: float = 1.0
    used_s: float = 0.0
    at: float = 0.0


@dataclass(frozen=True)
class FleetSnapshot:
    """The facts one pass decides from; each pass reads the part it needs (a
    recovery pass: ``stalled`` and ``dead``)."""

    now: float
    workers: tuple[Worker, ...] = ()
    queued: tuple[QueuedJob, ...] = ()
    held: tuple[HeldWork, ...] = ()
    running: tuple[RunningJob, ...] = ()
    submitted: tuple[SubmittedCount, ...] = ()
    tenants: tuple[TenantUsage, ...] = ()  # tenants with a weight or a recent use; others weigh 1, used 0
    # Jobs that may be stuck where they are, and the workers known dead.
    stalled: tuple[JobRecord, ...] = ()
    dead: tuple[DeadWorker, ...] = ()
