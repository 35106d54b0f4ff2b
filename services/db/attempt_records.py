"""What a worker's writes of an attempt take and return (the queries are
``services.db.repository.attempts``')."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from services.db.records import ImageRecord


class Standing(enum.Enum):
    """What a running attempt learns when it reports progress."""

    CURRENT = "current"
    CANCEL_REQUESTED = "cancel requested"
    SUSPEND_REQUESTED = "suspend requested"  # the scheduler wants its GPU for other work
    SUPERSEDED = "superseded"  # requeued or moved on: its work will not be used


@dataclass(frozen=True)
class StepReport:
    """A running attempt's progress: ``step`` of ``total`` steps done."""

    job_id: str
    attempt: int
    step: int
    total: int


@dataclass(frozen=True)
class StartRequest:
    job_id: str
    attempt: int
    dispatched_at: datetime | None = None  # when the scheduler published it


@dataclass(frozen=True)
class Result:
    """A job's stored outcome: its images, and what its worker measured."""

    job_id: str
    attempt: int
    images: Sequence[ImageRecord]
    decoded_at: datetime
    busy_s: float  # its share of its batch's sampling time: the GPU-seconds it is charged
    # How long its batch ran, when that is worth learning from (kept on one member
    # of a batch), and the images in that batch.
    run_seconds: float | None = None
    batch_rows: int | None = None
    # Images already running in the batch it joined at a step boundary; None: it began its batch.
    joined_rows: int | None = None
    # Steps of each of its images that reused a prediction (step caching); None: off.
    cached_steps: int | None = None
