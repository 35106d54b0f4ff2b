"""The fleet and a caller's recent jobs as JSON, for the page (and any client):
GetStats and ListJobs in the shapes a browser reads. Pure."""

from __future__ import annotations

from typing import Any

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

STAGES = ("queue", "schedule", "dispatch", "sample", "decode", "store", "total")


def fleet(stats: pb.GetStatsResponse) -> dict[str, Any]:
    """Each worker's state, models, jobs, temperature and memory; the queue by lane;
    the caller's usage. Workers and lanes are an admin key's (empty for others)."""
    return {
        "workers": [
            {
                "id": w.worker_id,
                "kind": w.kind,
                "state": w.state,
                "device": w.device,
                "capabilities": list(w.capabilities),
                "warm_models": list(w.warm_models),
                "running_jobs": list(w.running_jobs),
                "processing": w.processing,
                "completed": w.completed,
                "temperature_c": round(w.temperature_c, 1),
                "vram_used_bytes": w.vram_used_bytes,
                "vram_total_bytes": w.vram_total_bytes,
                "utilization_pct": round(w.utilization_pct, 1),
                "queued_images": w.queued_images,
            }
            for w in stats.workers
        ],
        "lanes": [
            {"lane": q.lane, "queued": q.queued, "held": q.held, "oldest_queued_seconds": q.oldest_queued_seconds}
            for q in stats.lanes
        ],
        "usage": {
            "tenant": stats.usage.tenant,
            "lane": stats.usage.lane,
            "queued": stats.usage.queued,
            "running": stats.usage.running,
            "gpu_seconds_today": stats.usage.gpu_seconds_today,
        },
    }


def job_summary(job: pb.Job, status: str) -> dict[str, Any]:
    """A job as the recent-jobs list shows it: what it made and each stage's seconds."""
    durations = job.stage_durations
    return {
        "id": job.job_id,
        "status": status,
        "task": job.task,
        "model": job.model,
        "prompt": job.prompt,
        "size": f"{job.width}x{job.height}",
        "frames": job.frames,
        "worker_id": job.worker_id,
        "created": job.timings.created_time.seconds,
        "stages": {s: getattr(durations, f"{s}_seconds") for s in STAGES if durations.HasField(f"{s}_seconds")},
    }
