"""What the repository takes and returns of the worker registry: plain frozen
records, apart from the queries that make them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from services.db.states import WorkerKind, WorkerStatus


@dataclass(frozen=True)
class WorkerRecord:
    id: str
    kind: WorkerKind
    address: str
    device: str
    status: WorkerStatus
    models: tuple[str, ...]
    warm_models: tuple[str, ...]
    vram_total_bytes: int
    vram_used_bytes: int
    temperature_c: float
    speed: float
    completed: int
    errors: int
    busy_seconds: float
    telemetry: dict[str, Any]
    started_at: datetime
    last_heartbeat: datetime
    planned_models: tuple[str, ...] = ()
    primary_model: str | None = None
    restarts: int = 0
    # The kinds of work it serves ("image", "video", "upscale"): its models' capabilities.
    capabilities: tuple[str, ...] = ()
    # Whether its last heartbeat is recent, judged by the database's clock.
    live: bool = True

    @classmethod
    def of(cls, row: Mapping[str, Any], *, live: bool = True) -> WorkerRecord:
        """From a row of ``workers`` (every column of WORKER_COLUMNS)."""
        values = {name: row[name] for name in WORKER_FIELDS}
        values["kind"] = WorkerKind(row["kind"])
        values["status"] = WorkerStatus(row["status"])
        values["models"] = tuple(row["models"])
        values["warm_models"] = tuple(row["warm_models"])
        values["planned_models"] = tuple(row["planned_models"] or ())
        values["capabilities"] = tuple(row["capabilities"] or ())
        return cls(**values, live=live)


@dataclass(frozen=True)
class WorkerHeartbeat:
    id: str
    kind: WorkerKind
    address: str
    device: str
    models: tuple[str, ...]
    warm_models: tuple[str, ...]
    vram_total_bytes: int = 0
    vram_used_bytes: int = 0
    temperature_c: float = 0.0
    speed: float = 1.0
    status: WorkerStatus = WorkerStatus.READY
    restarts: int = 0
    telemetry: dict[str, Any] = field(default_factory=dict)
    capabilities: tuple[str, ...] = ()


@dataclass(frozen=True)
class WarmPlan:
    primary: str | None
    models: tuple[str, ...]


@dataclass(frozen=True)
class Registration:
    """What a worker learns when it starts: the jobs an earlier incarnation of it
    held that went back to the queue. (Its warm plan it reads from presence.)"""

    requeued: tuple[str, ...]


@dataclass(frozen=True)
class DeadWorker:
    """A worker whose jobs must go back to the queue, and why."""

    id: str
    reason: str


WORKER_FIELDS = tuple(f.name for f in fields(WorkerRecord) if f.name != "live")
# The columns a WorkerRecord is read from, for SELECT and RETURNING lists.
WORKER_COLUMNS = ", ".join(WORKER_FIELDS)
