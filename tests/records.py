"""Records as the repository returns them, for unit tests of the code that uses them."""

from __future__ import annotations

from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from services.db.columns import flat
from services.db.records import JobRecord, JobSummary, NewJob, RunningJobRecord
from services.db.states import JobStatus, WorkerKind, WorkerStatus
from services.db.worker_records import WorkerRecord
from services.generation import GenerationParams, JobShape

# In the past: a span that would end before it starts is clamped.
T0 = datetime.now(UTC) - timedelta(minutes=5)


PARAMS = GenerationParams("tiny", "a fox", "", 64, 64, 4, 7.5, 7, 1)
_GENERATION = {f.name for f in fields(GenerationParams)}


def _split(changes: dict[str, Any], params: GenerationParams) -> tuple[GenerationParams, dict[str, Any]]:
    """Changes to the generation parameters (given flat: ``model=``, ``steps=``) applied
    to ``params``, and the rest."""
    own = {k: v for k, v in changes.items() if k in _GENERATION}
    return replace(params, **own), {k: v for k, v in changes.items() if k not in _GENERATION}


def new_job(**changes: Any) -> NewJob:
    params, rest = _split(changes, PARAMS)
    return replace(NewJob("job-1", "free", 0, params, None), **rest)


def record(new: NewJob | None = None, **changes: Any) -> JobRecord:
    """The job as stored once ``new`` was submitted, with ``changes`` (generation
    parameters among them given flat)."""
    new = new or new_job()
    params, rest = _split(changes, new.params)
    submitted = {k: v for k, v in new.__dict__.items() if k in JobRecord.__dataclass_fields__ and k != "params"}
    job = JobRecord(
        **submitted,
        params=params,
        status=JobStatus.QUEUED,
        attempt=0,
        worker_id=None,
        error="",
        progress_step=0,
        progress_total=0,
        routing=None,
        cancel_requested=False,
        created_at=T0,
        scheduled_at=None,
        started_at=None,
        decoding_at=None,
        finished_at=None,
    )
    return replace(job, **rest)


def summary(new: NewJob | None = None, **changes: Any) -> JobSummary:
    """The job as the scheduler reads it (a ``JobSummary``), with ``changes``."""
    job = record(new, **changes)
    return JobSummary.of(flat(job))


def worker_record(worker_id: str, models: tuple[str, ...] = ("sd",), **changes: Any) -> WorkerRecord:
    """A worker as the registry holds it: a ready sampler, serving and warm with
    ``models``, unless ``changes`` say otherwise."""
    now = datetime.now(UTC)
    worker = WorkerRecord(
        id=worker_id,
        kind=WorkerKind.SAMPLER,
        address="",
        device="cpu",
        status=WorkerStatus.READY,
        models=models,
        warm_models=models,
        vram_total_bytes=0,
        vram_used_bytes=0,
        temperature_c=0.0,
        speed=1.0,
        completed=0,
        errors=0,
        busy_seconds=0.0,
        telemetry={},
        started_at=now,
        last_heartbeat=now,
    )
    return replace(worker, **changes)


def running_job(**changes: Any) -> RunningJobRecord:
    """A video job running on worker "a", 10 of its 30 steps done, suspended once."""
    job = RunningJobRecord(
        id="v",
        attempt=2,
        worker_id="a",
        lane="free",
        priority=0,
        shape=JobShape("vid", 512, 512, 30, 7.5, 1),
        progress_step=10,
        preemptions=1,
        suspend_requested=False,
        started_at=T0,
    )
    return replace(job, **changes)
