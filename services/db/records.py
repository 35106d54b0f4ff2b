"""What the repository takes and returns: plain frozen records, apart from the
queries that make them, so that policy code can use them without SQL."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.db.columns import columns, values_of
from services.db.states import JobStatus
from services.db.tenant_records import DEFAULT_TENANT
from services.generation import AdapterUse, BatchKey, GenerationParams, JobInputs, JobShape, Task

# The longest idempotency key a job is stored with (its column's length): every door checks it.
MAX_IDEMPOTENCY_KEY = 256
# The longest job id a call may name (a job's is a UUID, 36 characters), and the
# longest model and lane names (their columns' lengths): every door checks them
# before a name reaches a query, a log line or an error message.
MAX_JOB_ID = 64
MAX_MODEL_NAME = 128
MAX_LANE_NAME = 32


@dataclass(frozen=True)
class NewJob:
    id: str
    lane: str
    priority: int
    params: GenerationParams
    idempotency_key: str | None
    deadline: datetime | None = None
    output_format: str = "png"
    trace_context: str | None = None
    tenant: str = DEFAULT_TENANT
    price: float = 1.0  # credits per GPU-second of its model
    credits_reserved: float = 0.0  # what its estimate costs: taken from a tenant with credits
    task: Task = Task.TEXT_TO_IMAGE
    previews: int = 0  # rough previews of each image its stream sends while it denoises
    inputs: JobInputs | None = None  # an edit's or upscale's input image (and mask)
    # The prompt as expanded at submit (services.safety.expansion), which the sampler
    # makes its images from on every attempt; None: not expanded.
    expanded_prompt: str | None = None
    # What the image filter's flag does to its outputs ("block", "blur", "flag"),
    # decided at submit; "": not checked.
    output_policy: str = ""


@dataclass(frozen=True)
class AttemptFailure:
    attempt: int
    worker_id: str
    error: str

    def describe(self) -> str:
        return f"attempt {self.attempt} on {self.worker_id}: {self.error}"


SUSPENDED = "suspended"
RESUMED = "resumed"


@dataclass(frozen=True)
class SuspendEvent:
    """A job was suspended at a step (its checkpoint stored, back to the queue), or
    an attempt resumed it from its checkpoint."""

    kind: str  # SUSPENDED or RESUMED
    attempt: int
    worker_id: str
    step: int
    total: int
    at: datetime
    reason: str = ""  # why it was suspended: "drain", "preempted for <job>"

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> SuspendEvent:
        return cls(
            kind=entry["kind"],
            attempt=int(entry["attempt"]),
            worker_id=entry["worker_id"],
            step=int(entry["step"]),
            total=int(entry["total"]),
            at=datetime.fromisoformat(entry["at"]),
            reason=entry.get("reason", ""),
        )


@dataclass(frozen=True)
class JobState:
    """What a stream reads of its job: where it stands, and its suspensions; the
    worker its latest attempt was placed on (None while it has none), whose events
    alone the stream tells its client."""

    status: JobStatus
    attempt: int
    suspend_log: tuple[SuspendEvent, ...] = ()
    tenant: str = DEFAULT_TENANT
    worker_id: str | None = None


@dataclass(frozen=True)
class JobCursor:
    """Where a page of a tenant's jobs ended: its last job's creation and id."""

    created_at: datetime
    id: str


@dataclass(frozen=True)
class StoredCheckpoint:
    """A job's latest denoising state as stored: written by ``attempt`` with ``step``
    of ``total`` steps done."""

    job_id: str
    attempt: int
    step: int
    total: int
    data: bytes


@dataclass(frozen=True)
class JobRecord:
    id: str
    status: JobStatus
    lane: str
    priority: int
    params: GenerationParams
    idempotency_key: str | None
    attempt: int
    worker_id: str | None
    error: str
    progress_step: int
    progress_total: int
    routing: dict[str, Any] | None
    cancel_requested: bool
    created_at: datetime
    scheduled_at: datetime | None
    started_at: datetime | None
    decoding_at: datetime | None
    finished_at: datetime | None
    deadline: datetime | None = None
    starts: int = 0
    failures: int = 0
    attempt_log: tuple[AttemptFailure, ...] = ()
    output_format: str = "png"
    batch_rows: int | None = None
    joined_rows: int | None = None  # images running in the batch it joined mid-way; None: it began one
    cached_steps: int | None = None  # steps that reused a prediction (step caching); None: off
    dispatched_at: datetime | None = None
    decoded_at: datetime | None = None
    trace_context: str | None = None
    checkpoint_step: int = 0  # steps its latest checkpoint holds done (0: none)
    checkpoint_attempt: int | None = None  # the attempt that wrote it
    preemptions: int = 0
    suspend_requested: bool = False
    suspend_log: tuple[SuspendEvent, ...] = ()
    aged_from: datetime | None = None
    tenant: str = DEFAULT_TENANT
    price: float = 1.0
    credits_reserved: float = 0.0
    gpu_seconds: float = 0.0  # charged so far: its share of its batches' sampling time
    credits_charged: float | None = None  # once settled
    task: Task = Task.TEXT_TO_IMAGE
    previews: int = 0
    output_policy: str = ""  # what the image filter's flag does to its outputs; "": not checked
    expanded_prompt: str | None = None  # what its images are made from, where its prompt was expanded

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> JobRecord:
        """From a row of ``jobs`` (every column of JOB_COLUMNS)."""
        values = values_of(cls, row)
        values["status"] = JobStatus(row["status"])
        values["task"] = Task(row["task"])
        values["attempt_log"] = tuple(AttemptFailure(**entry) for entry in row["attempt_log"] or ())
        values["suspend_log"] = tuple(SuspendEvent.of(entry) for entry in row["suspend_log"] or ())
        return cls(**values)

    @property
    def shape(self) -> JobShape:
        return self.params.shape

    @property
    def suspensions(self) -> tuple[SuspendEvent, ...]:
        return tuple(e for e in self.suspend_log if e.kind == SUSPENDED)

    @property
    def resumptions(self) -> tuple[SuspendEvent, ...]:
        return tuple(e for e in self.suspend_log if e.kind == RESUMED)


@dataclass(frozen=True)
class JobSummary:
    """What placing a job, or counting the work a worker holds, needs to know of it:
    a job without its prompt and routing, cheap to read by the hundred."""

    id: str
    status: JobStatus
    lane: str
    priority: int
    shape: JobShape
    attempt: int
    worker_id: str | None
    progress_step: int
    progress_total: int
    created_at: datetime
    scheduled_at: datetime | None
    attempt_log: tuple[AttemptFailure, ...]
    trace_context: str | None = None
    aged_from: datetime | None = None  # its priority ages from here (None: from its creation)
    tenant: str = DEFAULT_TENANT
    adapters: tuple[AdapterUse, ...] = ()  # its LoRA adapters: placement weighs their warmth

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> JobSummary:
        """From a row of ``jobs`` (every column of SUMMARY_COLUMNS)."""
        values = values_of(cls, row)
        values["status"] = JobStatus(row["status"])
        values["attempt_log"] = tuple(AttemptFailure(**entry) for entry in row["attempt_log"] or ())
        return cls(**values)


@dataclass(frozen=True)
class RunningJobRecord:
    """A job running on a worker, as preemption sees it."""

    id: str
    attempt: int
    worker_id: str
    lane: str
    priority: int
    shape: JobShape
    progress_step: int  # steps done, counted from the job's first step (a resumed job starts past 0)
    preemptions: int  # times it has been suspended for other work
    suspend_requested: bool  # a suspension is asked for and not yet done
    started_at: datetime | None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> RunningJobRecord:
        return cls(**values_of(cls, row))


@dataclass(frozen=True)
class HeldGroup:
    """Jobs one worker holds in one state with one batch key: what placement needs
    to know of the work a worker holds, read as a few groups rather than every job."""

    worker_id: str
    status: JobStatus
    key: BatchKey
    jobs: int
    images: int  # of all its jobs
    largest: int  # images of its largest job
    done: float  # the share of its steps done, of its most advanced job


@dataclass(frozen=True)
class ImageRecord:
    index: int
    data: bytes
    mime_type: str
    width: int
    height: int
    seed: int
    nsfw_score: float | None = None  # the image filter's score; None: not checked
    verdict: str = ""  # "", "flagged", "blurred" or "blocked" (then ``data`` is empty)


JOB_FIELDS = columns(JobRecord)
SUMMARY_FIELDS = columns(JobSummary)
# The columns a JobRecord or JobSummary is read from, for SELECT and RETURNING lists.
JOB_COLUMNS = ", ".join(JOB_FIELDS)
SUMMARY_COLUMNS = ", ".join(SUMMARY_FIELDS)


@dataclass(frozen=True)
class Assignment:
    """The scheduler's decision for one job: where it goes and why."""

    job_id: str
    worker_id: str
    routing: dict[str, Any]


# A learned estimate as stored: (mean, count).
Estimate = tuple[float, int]


@dataclass(frozen=True)
class RunTime:
    """How long one job ran on one worker: a fact to learn durations from."""

    model: str
    pixels: int
    steps: int
    batch: int
    worker_id: str
    seconds: float
