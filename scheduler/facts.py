"""A fleet snapshot from the database's records: what production knows of its
fleet, as ``scheduler.snapshot`` has the simulator know its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from scheduler import snapshot
from scheduler.policy import ModelCost
from services import reported as values
from services.db import counts, records, tenant_records, worker_records
from services.db.states import JobStatus, WorkerStatus
from services.seats import OpenSeat

_HOLDING = {
    JobStatus.RUNNING: snapshot.Holding.RUNNING,
    JobStatus.SCHEDULED: snapshot.Holding.WAITING,
    JobStatus.DECODING: snapshot.Holding.DECODING,
}


def queued_job(job: records.JobSummary | records.JobRecord) -> snapshot.QueuedJob:
    # A preempted job ages from its suspension (``aged_from``): back in the queue
    # with its old age, it would outrank at once the job it was suspended for.
    return snapshot.QueuedJob(
        id=job.id,
        shape=job.shape,
        lane=job.lane,
        priority=job.priority,
        queued_at=(job.aged_from or job.created_at).timestamp(),
        failed_on=frozenset(f.worker_id for f in job.attempt_log),
        tenant=job.tenant,
        adapters=frozenset(a.key for a in job.params.adapters)
        if isinstance(job, records.JobRecord)
        else frozenset(a.key for a in job.adapters),
    )


def measured(telemetry: Mapping[str, Any]) -> tuple[tuple[str, int, float], ...]:
    """(model, bytes, load seconds) of each model a sampler reports measuring; a
    value that is not what a sampler sends counts as unmeasured."""
    reported = telemetry.get("models")
    if not isinstance(reported, dict):
        return ()
    return tuple(
        (name, values.count(m, "bytes", most=values.UINT64), values.number(m, "load_s"))
        for name, m in reported.items()
        if isinstance(m, dict)
    )


def open_seats(telemetry: Mapping[str, Any]) -> tuple[OpenSeat, ...]:
    """The room a sampler reports in the batch it runs (``"open_seats"``); entries
    that are not what a sampler sends are passed over (``OpenSeat.of``)."""
    reported = telemetry.get("open_seats")
    if not isinstance(reported, list):
        return ()
    return tuple(seat for entry in reported if (seat := OpenSeat.of(entry)) is not None)


def resident_adapters(telemetry: Mapping[str, Any]) -> frozenset[str]:
    """The adapters a sampler reports resident on its device (``"adapters"``)."""
    reported = telemetry.get("adapters")
    if not isinstance(reported, list):
        return frozenset()
    return frozenset(a for a in reported if isinstance(a, str))


def worker(w: worker_records.WorkerRecord) -> snapshot.Worker:
    return snapshot.Worker(
        id=w.id,
        state=w.status,
        models=frozenset(w.models),
        warm_models=frozenset(w.warm_models),
        vram_total_bytes=w.vram_total_bytes,
        vram_used_bytes=w.vram_used_bytes,
        speed=w.speed,
        temperature_c=w.temperature_c,
        planned_models=frozenset(w.planned_models),
        primary_model=w.primary_model,
        measured=measured(w.telemetry),
        # None where it says none (registered before samplers advertised them): its models' then.
        capabilities=frozenset(w.capabilities) or None,
        open_seats=open_seats(w.telemetry),
        adapters=resident_adapters(w.telemetry),
        adapter_load_s=values.number(w.telemetry, "adapter_load_s"),
        gpus=group_size(w.telemetry),
    )


def group_size(telemetry: Mapping[str, Any]) -> int:
    """A group's devices, as its heartbeat says; 1 for a single sampler (or a group
    whose heartbeat says nothing readable)."""
    group = telemetry.get("group")
    size = group.get("size") if isinstance(group, Mapping) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= 64 else 1


def held_work(g: records.HeldGroup) -> snapshot.HeldWork:
    return snapshot.HeldWork(
        worker_id=g.worker_id,
        key=g.key,
        images=g.images,
        largest=g.largest,
        holding=_HOLDING[g.status],
        progress=snapshot.Progress(done=g.done),
    )


def running_job(r: records.RunningJobRecord) -> snapshot.RunningJob:
    return snapshot.RunningJob(
        id=r.id,
        attempt=r.attempt,
        worker_id=r.worker_id,
        lane=r.lane,
        shape=r.shape,
        preemptions=r.preemptions,
        suspend_requested=r.suspend_requested,
        progress=snapshot.Progress(done=min(r.progress_step / r.shape.steps, 1.0) if r.shape.steps > 0 else 0.0),
    )


def tenant(share: tenant_records.TenantShare) -> snapshot.TenantUsage:
    at = share.used_at.timestamp() if share.used_at is not None else 0.0
    return snapshot.TenantUsage(share.tenant, share.weight, share.used_s, at)


def fleet_snapshot(
    now: datetime,
    *,
    workers: Iterable[worker_records.WorkerRecord] = (),
    queued: Iterable[records.JobSummary | records.JobRecord] = (),
    held: Iterable[records.HeldGroup] = (),
    running: Iterable[records.RunningJobRecord] = (),
    submitted_counts: Iterable[counts.SubmittedCount] = (),
    stalled: Iterable[records.JobRecord] = (),
    dead: Iterable[worker_records.DeadWorker] = (),
    tenants: Iterable[snapshot.TenantUsage] = (),
) -> snapshot.FleetSnapshot:
    return snapshot.FleetSnapshot(
        now=now.timestamp(),
        workers=tuple(map(worker, workers)),
        queued=tuple(map(queued_job, queued)),
        held=tuple(held_work(g) for g in held if g.status in _HOLDING),
        running=tuple(map(running_job, running)),
        submitted=tuple(submitted_counts),
        stalled=tuple(stalled),
        dead=tuple(dead),
        tenants=tuple(tenants),
    )


def window_models(workers: Sequence[snapshot.Worker], costs: Mapping[str, ModelCost]) -> list[str]:
    """The models whose queued jobs a pass reads: those a live sampler serves, and
    those of a capability none serves (so that their jobs are told they wait for
    it). A job of a model no live sampler serves, of a capability others do,
    waits out of the pass's sight: a backlog of them must not fill a tenant's
    window and hide the jobs behind it that could run."""
    ready = [w for w in workers if w.state == WorkerStatus.READY]
    served = {m for w in ready for m in w.models}
    capabilities = {c for w in ready for c in (w.capabilities or {costs[m].capability for m in w.models if m in costs})}
    return sorted(m for m, cost in costs.items() if m in served or cost.capability not in capabilities)
