"""learned durations and worker speeds; the planner's warm set per worker

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "learned_estimates",
        # "shape": seconds at speed 1.0 for a (model, pixels, steps, batch) key;
        # "speed": a worker's speed relative to the fleet.
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("key", sa.String(256), primary_key=True),
        sa.Column("mean", sa.Float, nullable=False),
        sa.Column("count", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("kind IN ('shape','speed')", name="ck_learned_estimates_kind"),
    )
    op.add_column("workers", sa.Column("planned_models", JSONB, nullable=False, server_default=sa.text("'[]'")))
    op.add_column("workers", sa.Column("primary_model", sa.String(128)))
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_created_at", "jobs")
    op.drop_column("workers", "primary_model")
    op.drop_column("workers", "planned_models")
    op.drop_table("learned_estimates")
