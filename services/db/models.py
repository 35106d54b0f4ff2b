"""The schema, described once, as SQLAlchemy 2 models. The Alembic migrations in
``migrations/`` build exactly this (``tests/integration/test_schema.py`` compares
them, and new migrations can be drafted from it with ``alembic revision
--autogenerate``); the records in ``records.py`` read and write only its columns."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    lane: Mapped[str] = mapped_column(String(32), nullable=False)
    priority: Mapped[int] = mapped_column(Integer, nullable=False)
    model: Mapped[str] = mapped_column(String(128), nullable=False)
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
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
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
    # Credits taken from its tenant at submit, from the estimate; settled when it ends.
    credits_reserved: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    # Its share of the sampling time of the batches it ran in, over the attempts
    # charged (not those that failed through no fault of its own).
    gpu_seconds: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    # gpu_seconds times price, once settled: what its tenant paid.
    credits_charged: Mapped[float | None] = mapped_column(Float)
    settled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

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
    )


class TenantRow(Base):
    """Who may submit, in which lane, and how much."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Its jobs run in this lane; a request may ask for a lower one, never a higher.
    lane: Mapped[str] = mapped_column(String(32), nullable=False)
    # GPU-seconds it may still spend (times the model's price); NULL: no limit.
    credits: Mapped[float | None] = mapped_column(Float)
    # Credits given back each day; NULL: none.
    daily_credits: Mapped[float | None] = mapped_column(Float)
    # At most this many of its jobs queued or running at once; NULL: no limit.
    max_jobs: Mapped[int | None] = mapped_column(Integer)
    # Submits per second, shared by every gateway; NULL: no limit.
    rate_per_s: Mapped[float | None] = mapped_column(Float)
    # Its share of its lane's GPUs against the other tenants there.
    weight: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("1"))
    # Its rate's token bucket: the submits it held at rate_at (NULL: never drawn on, full).
    rate_tokens: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    rate_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The UTC day its daily credits were last given (NULL: never).
    credits_day: Mapped[date | None] = mapped_column(Date)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class TenantUsageRow(Base):
    """What a tenant's jobs cost on a UTC day, as they were settled. Not a foreign
    key: the default tenant needs no row."""

    __tablename__ = "tenant_usage"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    jobs: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    gpu_seconds: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    credits: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))


class TenantShareRow(Base):
    """A tenant's GPU-seconds for fair sharing, decayed as of ``used_at``: the
    scheduler's settlement adds to it (``scheduler.fair_share`` decays it)."""

    __tablename__ = "tenant_shares"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    used_s: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    used_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class ApiKeyRow(Base):
    """A tenant's key, stored only as a digest: the key itself is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), ForeignKey("tenants.name", ondelete="CASCADE"), nullable=False)
    digest: Mapped[str] = mapped_column(String(64), nullable=False)  # SHA-256 of the whole key, hex
    # May read the whole fleet's detail (GetStats).
    admin: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_api_keys_tenant", "tenant"),)


class AdminActionRow(Base):
    """An admin action (a tenant created or changed, a key made or revoked): who, when."""

    __tablename__ = "admin_actions"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # Who did it: the operating-system user and host the `darkroom` command ran as.
    actor: Mapped[str] = mapped_column(String(200), nullable=False)
    action: Mapped[str] = mapped_column(String(32), nullable=False)  # e.g. "keys revoke"
    tenant: Mapped[str] = mapped_column(String(64), nullable=False)
    key_id: Mapped[str | None] = mapped_column(String(32))
    # The terms set, or the key's role; never a key.
    detail: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))

    __table_args__ = (Index("ix_admin_actions_tenant_at", "tenant", "at"),)


class JobImageRow(Base):
    __tablename__ = "job_images"

    job_id: Mapped[str] = mapped_column(String(36), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    mime_type: Mapped[str] = mapped_column(String(32), nullable=False)
    width: Mapped[int] = mapped_column(Integer, nullable=False)
    height: Mapped[int] = mapped_column(Integer, nullable=False)
    seed: Mapped[int] = mapped_column(BigInteger, nullable=False)


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
