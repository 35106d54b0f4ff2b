"""The schema, described once, as SQLAlchemy 2 models. The Alembic migrations in
``migrations/`` build exactly this (``tests/integration/test_schema.py`` compares
them, and new migrations can be drafted from it with ``alembic revision
--autogenerate``); the records in ``records.py`` read and write only its columns.

Here: the jobs' tables, the worker registry and the learned estimates. The
tenants' tables are in ``tenant_models.py``, on the same ``Base`` (``base.py``);
importing this module defines every table, so ``Base.metadata`` is the whole schema."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from services.db.base import Base
from services.db.records import MAX_IDEMPOTENCY_KEY, MAX_LANE_NAME, MAX_MODEL_NAME
from services.db.tenant_models import AdminActionRow, ApiKeyRow, TenantRow, TenantShareRow, TenantUsageRow

__all__ = [
    "AdminActionRow",
    "ApiKeyRow",
    "Base",
    "JobCheckpointRow",
    "JobImageRow",
    "JobInputRow",
    "JobRow",
    "LearnedEstimateRow",
    "TenantRow",
    "TenantShareRow",
    "TenantUsageRow",
    "WorkerRow",
]


class JobRow(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    lane: Mapped[str] = mapped_column(String(MAX_LANE_NAME), nullable=False)
    priority: Mapped[int] = mapped_column(Integer, nullable=False)
    model: Mapped[str] = mapped_column(String(MAX_MODEL_NAME), nullable=False)
    prompt: Mapped[str] = mapped_column(Text, nullable=False)
    negative_prompt: Mapped[str] = mapped_column(Text, nullable=False)
    width: Mapped[int] = mapped_column(Integer, nullable=False)
    height: Mapped[int] = mapped_column(Integer, nullable=False)
    steps: Mapped[int] = mapped_column(Integer, nullable=False)
    guidance_scale: Mapped[float] = mapped_column(Float, nullable=False)
    seed: Mapped[int] = mapped_column(BigInteger, nullable=False)
    num_images: Mapped[int] = mapped_column(Integer, nullable=False)
    # A video's frames (1: an image) and frames per second (0: an image).
    frames: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("1"))
    fps: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    # An edit's share of the denoising (1: all of it, as without an input image).
    strength: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("1"))
    # Its LoRA adapters, [{"name", "version", "scale"[, "owner"]}, ...] in the order it
    # named them; "owner": the tenant whose own adapter it is (none: the store's).
    adapters: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'"))
    # Rough previews of each image its stream sends while it denoises (0..3).
    previews: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # What it makes: a services.generation.Task.
    task: Mapped[str] = mapped_column(String(16), nullable=False, server_default=text("'text_to_image'"))
    # SHA-256 (hex) of its input image and mask in ``job_inputs``; '': none.
    image_digest: Mapped[str] = mapped_column(String(64), nullable=False, server_default=text("''"))
    mask_digest: Mapped[str] = mapped_column(String(64), nullable=False, server_default=text("''"))
    # "png", "jpeg" or "webp" (an image's or an animated WebP), or "mp4" (a video's):
    # how the decoder encodes the outputs.
    output_format: Mapped[str] = mapped_column(String(8), nullable=False, server_default=text("'png'"))
    idempotency_key: Mapped[str | None] = mapped_column(String(MAX_IDEMPOTENCY_KEY))
    # Raised each time the job is dispatched: the fencing token. A worker's writes
    # name the attempt they belong to, so a stale attempt never overwrites a newer one.
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # How many times an attempt started running (a drain's hand-back of an unstarted
    # job does not start one).
    starts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # Attempts that failed (a crash, a timeout, an error); a hand-back does not count.
    failures: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # One entry per failed attempt: {"attempt", "worker_id", "error"}.
    attempt_log: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'"))
    deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # How long the successful attempt ran, as its worker measured it; NULL when the
    # duration says little (it loaded the model, or warmed it up). The scheduler
    # folds it into the learned estimates once, then sets ``learned``.
    run_seconds: Mapped[float | None] = mapped_column(Float)
    # Images in the batch the successful attempt ran in, its own included: the
    # shape ``run_seconds`` (kept on one member of the batch) is learned under.
    batch_rows: Mapped[int | None] = mapped_column(Integer)
    # Images already running in the batch it joined at a step boundary; NULL: it began its batch.
    joined_rows: Mapped[int | None] = mapped_column(Integer)
    cached_steps: Mapped[int | None] = mapped_column(Integer)
    learned: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    worker_id: Mapped[str | None] = mapped_column(String(128))
    error: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    progress_step: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    progress_total: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    routing: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # The stages of the latest attempt: placed by the scheduler, published to its
    # worker (the scheduler's clock, written by the worker), started, sampled
    # (decoding begins), decoded, stored.
    scheduled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    decoding_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    decoded_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # W3C trace context (traceparent) of the submit: each service's spans join its trace.
    trace_context: Mapped[str | None] = mapped_column(String(128))
    # The latest denoising checkpoint (in ``job_checkpoints``): the steps it holds
    # done, and the attempt that wrote it. Only the checkpoint these name is resumed
    # from: a write from any other attempt is refused, so a stale one is never used.
    checkpoint_step: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    checkpoint_attempt: Mapped[int | None] = mapped_column(Integer)
    # Times suspended to make room for other work (a drain's suspension does not count).
    preemptions: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    # The scheduler asked its worker to suspend it at the next step.
    suspend_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    # Why (the scheduler's reason, "preempted for <job>"), for a worker that learns of it from the flag.
    suspend_reason: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    # One entry per suspension and resumption: {"kind", "attempt", "worker_id", "step", "reason", "at"}.
    suspend_log: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'"))
    # Its priority ages from here rather than from its creation: a job suspended
    # for other work waits anew, or it would outrank at once the job it made room for.
    aged_from: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The tenant whose key submitted it ("default" when no tenants are defined, or
    # for the keys of DARKROOM_API_KEYS). Not a foreign key: "default" needs no row.
    tenant: Mapped[str] = mapped_column(String(64), nullable=False, server_default=text("'default'"))
    # Credits per GPU-second of its model when it was submitted (the registry's price).
    price: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("1"))
    # Credits its tenant's balance holds for it from submit until it is settled: its
    # estimate, or 0 for a tenant without a credit limit.
    credits_reserved: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    # Its share of the sampling time of the batches it ran in, over the attempts
    # charged (not those that failed through no fault of its own).
    gpu_seconds: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    # gpu_seconds times price, once settled: what its tenant paid.
    credits_charged: Mapped[float | None] = mapped_column(Float)
    settled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The prompt as expanded at submit (services.safety's expanders), which its images
    # are made from on every attempt; NULL: not expanded.
    expanded_prompt: Mapped[str | None] = mapped_column(Text)
    # What the image filter's flag does to its outputs, decided at submit from its
    # tenant's or its lane's policy: "block", "blur" or "flag"; '': not checked.
    output_policy: Mapped[str] = mapped_column(String(8), nullable=False, server_default=text("''"))

    __table_args__ = (
        Index("ix_jobs_queue", "priority", "created_at", postgresql_where=text("status = 'QUEUED'")),
        Index(
            "ix_jobs_queued_by_lane_tenant", "lane", "tenant", "created_at", postgresql_where=text("status = 'QUEUED'")
        ),
        Index("ix_jobs_created_at", "created_at"),
        Index(
            "ix_jobs_worker_active", "worker_id", postgresql_where=text("status IN ('SCHEDULED','RUNNING','DECODING')")
        ),
        Index("ix_jobs_to_learn", "finished_at", postgresql_where=text("run_seconds IS NOT NULL AND NOT learned")),
        Index(
            "ux_jobs_tenant_idempotency_key",
            "tenant",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        Index("ix_jobs_tenant_created", "tenant", "created_at", "id"),
        Index(
            "ix_jobs_tenant_active",
            "tenant",
            postgresql_where=text("status IN ('QUEUED','SCHEDULED','RUNNING','DECODING')"),
        ),
        Index(
            "ix_jobs_unsettled",
            "finished_at",
            postgresql_where=text("settled_at IS NULL AND status IN ('SUCCEEDED','FAILED','CANCELLED','EXPIRED')"),
        ),
        # A tenant's open jobs, whose reservations its credits hold apart.
        Index("ix_jobs_tenant_unsettled", "tenant", postgresql_where=text("settled_at IS NULL")),
    )


class JobImageRow(Base):
    __tablename__ = "job_images"

    job_id: Mapped[str] = mapped_column(String(36), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    mime_type: Mapped[str] = mapped_column(String(32), nullable=False)
    width: Mapped[int] = mapped_column(Integer, nullable=False)
    height: Mapped[int] = mapped_column(Integer, nullable=False)
    seed: Mapped[int] = mapped_column(BigInteger, nullable=False)
    # The image filter's NSFW score in [0, 1]; NULL: not checked.
    nsfw_score: Mapped[float | None] = mapped_column(Float)
    # '': passed or not checked; "flagged" (kept as made), "blurred", or "blocked"
    # (its bytes never stored: ``data`` is empty).
    verdict: Mapped[str] = mapped_column(String(8), nullable=False, server_default=text("''"))


class JobInputRow(Base):
    """A job's input image and inpainting mask, as submitted (edits and upscales)."""

    __tablename__ = "job_inputs"

    job_id: Mapped[str] = mapped_column(String(36), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    image: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    mask: Mapped[bytes | None] = mapped_column(LargeBinary)


class JobCheckpointRow(Base):
    """A job's latest denoising state, written by the attempt ``jobs.checkpoint_attempt`` names."""

    __tablename__ = "job_checkpoints"

    job_id: Mapped[str] = mapped_column(String(36), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, nullable=False)
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    total: Mapped[int] = mapped_column(Integer, nullable=False)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class WorkerRow(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)  # WorkerKind
    address: Mapped[str] = mapped_column(String(256), nullable=False)
    device: Mapped[str] = mapped_column(String(128), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)  # WorkerStatus
    # A new one on every start of the process; jobs held under an older one are requeued.
    incarnation: Mapped[str | None] = mapped_column(String(36))
    # How many times its supervisor has restarted it.
    restarts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    models: Mapped[list[str]] = mapped_column(JSONB, nullable=False)
    # What kinds of work it serves ("image", "video", "upscale"): its models' capabilities.
    capabilities: Mapped[list[str]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'"))
    warm_models: Mapped[list[str]] = mapped_column(JSONB, nullable=False)
    vram_total_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    vram_used_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    temperature_c: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    speed: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("1"))
    completed: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    errors: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    busy_seconds: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    telemetry: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # Written with the database's clock, and judged against it: hosts' clocks may differ.
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # Written by the scheduler's planning loop; the worker loads and drops to match.
    planned_models: Mapped[list[str]] = mapped_column(JSONB, nullable=False, server_default=text("'[]'"))
    primary_model: Mapped[str | None] = mapped_column(String(128))


class LearnedEstimateRow(Base):
    __tablename__ = "learned_estimates"

    kind: Mapped[str] = mapped_column(String(8), primary_key=True)  # "shape" or "speed"
    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    mean: Mapped[float] = mapped_column(Float, nullable=False)
    count: Mapped[int] = mapped_column(BigInteger, nullable=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
