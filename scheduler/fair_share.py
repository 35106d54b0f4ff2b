"""Fair shares within a lane: tenants take turns by weight and by the GPU-seconds
their jobs used lately, forgotten exponentially (the decayed usage of Slurm's
fair-share factor and of Kueue's admission fair sharing). Pure: usage and jobs in,
the queue's views out; production and the simulator both call it through
``scheduler.driver.place``.

A lane keeps its turns: the times its queued jobs wait from, which the queue
orders by deadline or by age. Who takes each turn is what changes. Each tenant's
jobs, oldest first, are tagged with what the tenant will have used by the time
that job starts (its decayed use plus the estimated seconds of its own jobs ahead
of it), over its weight; the lowest tag takes the lane's earliest turn. So a tenant
that used little goes first, and a heavy tenant's backlog interleaves with the
others' work instead of standing in front of it. Only the order changes: every job
stays placeable, and no GPU idles while any tenant has work (work-conserving).

Taking an older turn, a job takes its urgency too: the lane's oldest job is the one
about to miss its target, whoever's it now is, and preemption acts for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from scheduler.policy import JobView
from scheduler.snapshot import TenantUsage


def decayed(used_s: float, elapsed_s: float, half_life_s: float) -> float:
    """GPU-seconds used ``elapsed_s`` ago, as they count now."""
    return used_s * 0.5 ** (max(elapsed_s, 0.0) / half_life_s)


def used_by(usage: TenantUsage, now: float, half_life_s: float) -> float:
    return decayed(usage.used_s, now - usage.at, half_life_s)


def charged(usage: TenantUsage, seconds: float, *, now: float, half_life_s: float) -> TenantUsage:
    """``usage`` with ``seconds`` more used at ``now``."""
    return replace(usage, used_s=used_by(usage, now, half_life_s) + seconds, at=now)


def fair_turns(
    jobs: Sequence[JobView],
    tenants: Iterable[TenantUsage],
    seconds: Callable[[JobView], float],
    *,
    now: float,
    half_life_s: float,
) -> list[JobView]:
    """``jobs`` with the turns (``queued_at``) of each lane and latency class dealt
    out fairly among their tenants; ``seconds`` estimates a job's GPU-seconds. A
    tenant without a ``TenantUsage`` weighs 1 and has used nothing."""
    classes: dict[tuple[str, float | None], list[JobView]] = {}
    for job in jobs:
        classes.setdefault((job.lane, job.target_s), []).append(job)
    shared = {key for key, queue in classes.items() if len({j.tenant for j in queue}) > 1}
    if not shared:
        return list(jobs)
    usage = {u.tenant: u for u in tenants}
    turned: list[JobView] = []
    for key, queue in classes.items():
        if key not in shared:
            turned.extend(queue)
            continue
        turns = sorted(queue, key=lambda j: (j.queued_at, j.id))
        ahead: dict[str, float] = {}
        tagged = []
        for job in turns:
            u = usage.get(job.tenant)
            if job.tenant not in ahead:
                ahead[job.tenant] = used_by(u, now, half_life_s) if u else 0.0
            weight = max(u.weight, 1e-9) if u else 1.0
            tagged.append((ahead[job.tenant] / weight, job.queued_at, job.id, job))
            ahead[job.tenant] += seconds(job)
        tagged.sort(key=lambda t: t[:3])
        turned.extend(
            job if job.queued_at == turn.queued_at else replace(job, queued_at=turn.queued_at)
            for turn, (*_, job) in zip(turns, tagged, strict=True)
        )
    return turned
