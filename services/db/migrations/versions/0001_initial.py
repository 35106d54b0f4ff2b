"""jobs, job images and the worker registry

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_STATUSES = "'QUEUED','SCHEDULED','RUNNING','DECODING','SUCCEEDED','FAILED','CANCELLED','EXPIRED'"


def upgrade() -> None:
    tz = sa.DateTime(timezone=True)
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lane", sa.String(32), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("negative_prompt", sa.Text, nullable=False),
        sa.Column("width", sa.Integer, nullable=False),
        sa.Column("height", sa.Integer, nullable=False),
        sa.Column("steps", sa.Integer, nullable=False),
        sa.Column("guidance_scale", sa.Float, nullable=False),
        sa.Column("seed", sa.BigInteger, nullable=False),
        sa.Column("num_images", sa.Integer, nullable=False),
        sa.Column("idempotency_key", sa.String(256)),
        sa.Column("attempt", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("worker_id", sa.String(128)),
        sa.Column("error", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("progress_step", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("progress_total", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("routing", JSONB),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("created_at", tz, nullable=False),
        sa.Column("scheduled_at", tz),
        sa.Column("started_at", tz),
        sa.Column("decoding_at", tz),
        sa.Column("finished_at", tz),
        sa.CheckConstraint(f"status IN ({_STATUSES})", name="ck_jobs_status"),
    )
    op.create_index("ix_jobs_queue", "jobs", ["priority", "created_at"], postgresql_where=sa.text("status = 'QUEUED'"))
    op.create_index(
        "ix_jobs_worker_active",
        "jobs",
        ["worker_id"],
        postgresql_where=sa.text("status IN ('SCHEDULED','RUNNING','DECODING')"),
    )
    op.create_index(
        "ux_jobs_idempotency_key",
        "jobs",
        ["idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_table(
        "job_images",
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("index", sa.Integer, primary_key=True),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("mime_type", sa.String(32), nullable=False),
        sa.Column("width", sa.Integer, nullable=False),
        sa.Column("height", sa.Integer, nullable=False),
        sa.Column("seed", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("device", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("models", JSONB, nullable=False),
        sa.Column("warm_models", JSONB, nullable=False),
        sa.Column("vram_total_bytes", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("vram_used_bytes", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("temperature_c", sa.Float, nullable=False, server_default=sa.text("0")),
        sa.Column("speed", sa.Float, nullable=False, server_default=sa.text("1")),
        sa.Column("completed", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("errors", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("busy_seconds", sa.Float, nullable=False, server_default=sa.text("0")),
        sa.Column("telemetry", JSONB, nullable=False),
        sa.Column("started_at", tz, nullable=False),
        sa.Column("last_heartbeat", tz, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("job_images")
    op.drop_table("jobs")
