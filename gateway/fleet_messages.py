"""The fleet as the public API shows it: workers, lanes, totals and models."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from services import reported
from services.db.counts import LaneCount, Totals
from services.db.states import JobStatus, WorkerStatus
from services.db.worker_records import WorkerRecord
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb


def worker_stats(w: WorkerRecord, processing: int, running: Sequence[str] = ()) -> pb.WorkerStats:
    average_s = w.busy_seconds / w.completed if w.completed else 0.0
    t = w.telemetry
    return pb.WorkerStats(
        worker_id=w.id,
        kind=w.kind.value,
        available=w.status == WorkerStatus.READY and w.live,
        processing=processing,
        completed=w.completed,
        average_seconds=average_s,
        estimated_load_seconds=processing * average_s,
        errors=w.errors,
        temperature_c=w.temperature_c,
        vram_used_bytes=w.vram_used_bytes,
        vram_total_bytes=w.vram_total_bytes,
        device=w.device,
        warm_models=list(w.warm_models),
        restarts=w.restarts,
        state=(w.status if w.live or w.status == WorkerStatus.GONE else WorkerStatus.UNRESPONSIVE).value,
        telemetry_source=reported.text(t, "source", "none"),
        telemetry_note=reported.text(t, "unavailable"),
        utilization_pct=reported.number(t, "utilization_pct"),
        memory_utilization_pct=reported.number(t, "memory_utilization_pct"),
        power_w=reported.number(t, "power_w"),
        power_limit_w=reported.number(t, "power_limit_w"),
        sm_clock_mhz=reported.count(t, "sm_clock_mhz"),
        max_sm_clock_mhz=reported.count(t, "max_sm_clock_mhz"),
        throttle_reasons=list(reported.texts(t, "throttle_reasons")),
        queued_images=reported.count(t, "queued_images"),
        capabilities=list(w.capabilities),
        running_jobs=list(running),
        denoise_busy_ratio=reported.number(t, "denoise_busy_ratio"),
        denoising_seconds=reported.number(t, "denoising_seconds"),
        work_waiting_seconds=reported.number(t, "work_waiting_seconds"),
        denoised_batches=reported.count(t, "denoised_batches", most=reported.UINT64),
        host_gap_seconds=reported.number(t, "host_gap_seconds"),
    )


def lanes_message(counts: Sequence[LaneCount], now: datetime) -> list[pb.LaneQueue]:
    """The jobs not yet ended, by lane: queued, held by GPUs, the oldest queued's wait."""
    lanes: dict[str, pb.LaneQueue] = {}
    for c in counts:
        lane = lanes.setdefault(c.lane, pb.LaneQueue(lane=c.lane))
        if c.status == JobStatus.QUEUED:
            lane.queued += c.count
            lane.oldest_queued_seconds = max(lane.oldest_queued_seconds, (now - c.oldest).total_seconds())
        else:
            lane.held += c.count
    return [lanes[name] for name in sorted(lanes)]


def totals_message(totals: Totals) -> pb.GlobalStats:
    return pb.GlobalStats(
        requests=totals.requests,
        queued=totals.queued,
        completed=totals.completed,
        failed=totals.failed,
        running=totals.running,
        cancelled=totals.cancelled,
        expired=totals.expired,
    )


def models_message(registry: ModelRegistry, workers: Sequence[WorkerRecord]) -> pb.ListModelsResponse:
    """The registry's models, each capability's default first, each with the live
    samplers that serve it and those where it is warm."""
    defaults = {registry.default_for(c) for c in registry.capabilities()}
    return pb.ListModelsResponse(
        models=[
            pb.ModelInfo(
                name=spec.name,
                family=spec.family,
                max_width=spec.max_width,
                max_height=spec.max_height,
                max_steps=spec.max_steps,
                default_steps=spec.default_steps,
                warm_on=[w.id for w in workers if spec.name in w.warm_models],
                capability=spec.capability,
                is_default=spec in defaults,
                size_step=spec.size_step,
                default_width=spec.default_width,
                default_height=spec.default_height,
                max_images=spec.max_images,
                max_frames=spec.max_frames,
                default_frames=spec.default_frames,
                frames_step=spec.frames_step,
                default_fps=spec.default_fps,
                edits=spec.edits,
                served_by=[w.id for w in workers if spec.name in w.models],
                adapters_per_job=spec.adapters_per_job if spec.adapter_slots else 0,
                adapter_rank=spec.adapter_rank if spec.adapter_slots else 0,
            )
            for spec in registry.listing()
        ]
    )
