"""credits: what each job reserved at submit, the GPU-seconds its attempts were
charged, and its settlement; the day a tenant's daily credits last refilled; and
each tenant's usage per day

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_ENDED_UNSETTLED = "settled_at IS NULL AND status IN ('SUCCEEDED','FAILED','CANCELLED','EXPIRED')"


def upgrade() -> None:
    op.add_column("jobs", sa.Column("price", sa.Float, nullable=False, server_default=sa.text("1")))
    op.add_column("jobs", sa.Column("credits_reserved", sa.Float, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("gpu_seconds", sa.Float, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("credits_charged", sa.Float))
    op.add_column("jobs", sa.Column("settled_at", sa.DateTime(timezone=True)))
    # Jobs that ended before credits existed have nothing to settle.
    op.execute("UPDATE jobs SET settled_at = finished_at WHERE finished_at IS NOT NULL")
    op.create_index("ix_jobs_unsettled", "jobs", ["finished_at"], postgresql_where=sa.text(_ENDED_UNSETTLED))
    op.add_column("tenants", sa.Column("credits_day", sa.Date))
    op.create_table(
        "tenant_usage",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("day", sa.Date, primary_key=True),
        sa.Column("jobs", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("gpu_seconds", sa.Float, nullable=False, server_default=sa.text("0")),
        sa.Column("credits", sa.Float, nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    op.drop_table("tenant_usage")
    op.drop_column("tenants", "credits_day")
    op.drop_index("ix_jobs_unsettled", table_name="jobs")
    for column in ("settled_at", "credits_charged", "gpu_seconds", "credits_reserved", "price"):
        op.drop_column("jobs", column)
