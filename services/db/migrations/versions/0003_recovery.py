"""recovery: worker incarnations and restarts, failed attempts, deadlines; durations as facts

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("incarnation", sa.String(36)))
    op.add_column("workers", sa.Column("restarts", sa.Integer, nullable=False, server_default=sa.text("0")))
    statuses = "'starting','ready','draining','unhealthy','gone'"
    op.create_check_constraint("ck_workers_status", "workers", f"status IN ({statuses})")
    op.add_column("jobs", sa.Column("starts", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("failures", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("attempt_log", JSONB, nullable=False, server_default=sa.text("'[]'")))
    op.add_column("jobs", sa.Column("deadline", sa.DateTime(timezone=True)))
    # Workers record facts (how long a job ran); the scheduler learns from them.
    op.add_column("jobs", sa.Column("run_seconds", sa.Float))
    op.add_column("jobs", sa.Column("learned", sa.Boolean, nullable=False, server_default=sa.text("false")))
    op.create_index(
        "ix_jobs_to_learn", "jobs", ["finished_at"], postgresql_where=sa.text("run_seconds IS NOT NULL AND NOT learned")
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_to_learn", "jobs")
    op.drop_column("jobs", "learned")
    op.drop_column("jobs", "run_seconds")
    op.drop_column("jobs", "deadline")
    op.drop_column("jobs", "attempt_log")
    op.drop_column("jobs", "failures")
    op.drop_column("jobs", "starts")
    op.drop_constraint("ck_workers_status", "workers")
    op.drop_column("workers", "restarts")
    op.drop_column("workers", "incarnation")
