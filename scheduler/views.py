"""Database records and registry entries as the policy's frozen views. Shared by the
scheduler, which places jobs, and the gateway, which estimates when they will run."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler import policy
from services.db.repository import JobRecord, WorkerRecord
from services.models.registry import ModelRegistry


def costs_from(registry: ModelRegistry) -> dict[str, policy.ModelCost]:
    return {
        name: policy.ModelCost(step_s_512=spec.step_ms_512 / 1000.0, load_s=spec.load_s, vram_bytes=spec.vram_bytes)
        for name, spec in registry.models.items()
    }


def job_view(job: JobRecord) -> policy.JobView:
    return policy.JobView(job.id, job.model, job.width, job.height, job.steps, job.num_images)


def worker_views(
    workers: Sequence[WorkerRecord], held: Sequence[JobRecord], costs: dict[str, policy.ModelCost]
) -> list[policy.WorkerView]:
    views = []
    for w in workers:
        mine = [j for j in held if j.worker_id == w.id]
        work = 0.0
        for j in mine:
            cost = costs.get(j.model)
            if cost is None:
                continue
            done = j.progress_step / j.progress_total if j.progress_total else 0.0
            work += policy.run_seconds(job_view(j), cost, w.speed) * (1.0 - done)
        views.append(
            policy.WorkerView(
                id=w.id,
                models=frozenset(w.models),
                warm_models=frozenset(w.warm_models),
                vram_total_bytes=w.vram_total_bytes,
                vram_used_bytes=w.vram_used_bytes,
                speed=w.speed,
                held_jobs=len(mine),
                held_work_s=work,
            )
        )
    return views
