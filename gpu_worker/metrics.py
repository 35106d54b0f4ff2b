"""The sampler's Prometheus metrics."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from prometheus_client import Counter, Gauge, Histogram

from services.telemetry import stages
from services.telemetry.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, LOAD_BUCKETS

STAGES = (*stages.STAGES, "total")

STAGE_SECONDS = Histogram(
    "darkroom_stage_seconds",
    "How long a job spent in each stage: queue, schedule, dispatch, sample, decode, store; total: submit to stored.",
    ["stage", "model"],
    buckets=LATENCY_BUCKETS,
)
CHECKPOINTS = Counter(
    "darkroom_checkpoints",
    "Denoising checkpoints stored, by kind: periodic, or taken by a suspension.",
    ["kind"],
)
SUSPENSIONS = Counter(
    "darkroom_suspensions",
    "Jobs suspended at a step and put back in the queue with their checkpoint, by cause: drain or preempted.",
    ["cause"],
)
RESUMED_STEPS = Counter(
    "darkroom_resumed_steps",
    "Denoising steps not run again because an attempt resumed its job from a checkpoint.",
)
COLD_LOADS = Counter(
    "darkroom_cold_loads", "Models a sampler loaded to run a job (not preloaded, not planned).", ["model"]
)
MODEL_LOAD_SECONDS = Histogram(
    "darkroom_model_load_seconds",
    "How long a sampler waited for a model to load into memory, its download from the model store included: "
    "time no job is charged.",
    ["model"],
    buckets=LOAD_BUCKETS,
)
MODEL_COMPILE_SECONDS = Histogram(
    "darkroom_model_compile_seconds",
    "Of a model's load, how long compiling its networks and warming them up for each batch bucket took "
    "(models with compile or optimize on).",
    ["model"],
    buckets=LOAD_BUCKETS,
)
MODEL_COMPILE_CACHE = Counter(
    "darkroom_model_compile_cache",
    "Compilations of a model by what the fleet's compile cache gave them: fleet (its artifacts loaded: no code "
    "generated), miss (compiled here, then shared), corrupt (an artifact that did not load: compiled here), "
    "untrusted (an artifact its signed record does not vouch for: not loaded, compiled here, shared in its place), "
    "unavailable (the store did not answer: compiled here, not shared), local (no signing key: nothing loaded or "
    "shared).",
    ["model", "result"],
)
BATCH_IMAGES = Histogram(
    "darkroom_batch_images",
    "Images in each batch a sampler ran through the denoising loop.",
    ["model"],
    buckets=BATCH_BUCKETS,
)
WORKER_INFLIGHT = Gauge(
    "darkroom_worker_inflight", "Jobs a sampler is running now (a batch counts each of its jobs).", ["worker"]
)


def observe_stages(model: str, times: Sequence[datetime | None]) -> None:
    """A stored job's stages (``services.telemetry.stages``) from its timestamps: created,
    placed, published, started, sampled, decoded, stored."""
    for stage, seconds in stages.durations(times).items():
        STAGE_SECONDS.labels(stage=stage, model=model).observe(seconds)


DENOISE_SECONDS = Counter(
    "darkroom_sampler_denoise_seconds",
    "Time a sampler's batches spent in the denoiser (model loads aside).",
)
WORK_WAITING_SECONDS = Counter(
    "darkroom_sampler_work_waiting_seconds",
    "Time a sampler had work: dispatches in hand, starting or sampling. Denoising over this is its busy ratio.",
)
DENOISE_BUSY_RATIO = Gauge(
    "darkroom_sampler_denoise_busy_ratio",
    "Share of the time work waited on a sampler that it spent denoising, since it started (1 before any work); "
    "rate(darkroom_sampler_denoise_seconds) / rate(darkroom_sampler_work_waiting_seconds) gives it over a window.",
)
HOST_GAP_SECONDS = Histogram(
    "darkroom_sampler_host_gap_seconds",
    "The host's time between one batch's denoising and the next while work waited: the GPU idle for the host.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)
