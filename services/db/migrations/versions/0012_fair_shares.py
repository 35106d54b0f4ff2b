"""fair shares: each tenant's GPU-seconds, decayed as of a time; the queue read
by lane and tenant, so a pass sees every tenant's oldest jobs

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_QUEUED = sa.text("status = 'QUEUED'")


def upgrade() -> None:
    op.create_table(
        "tenant_shares",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("used_s", sa.Float, nullable=False, server_default=sa.text("0")),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_jobs_queued_by_lane_tenant", "jobs", ["lane", "tenant", "created_at"], postgresql_where=_QUEUED)
    op.drop_index("ix_jobs_queued_by_lane", "jobs")


def downgrade() -> None:
    op.create_index("ix_jobs_queued_by_lane", "jobs", ["lane", "created_at"], postgresql_where=_QUEUED)
    op.drop_index("ix_jobs_queued_by_lane_tenant", "jobs")
    op.drop_table("tenant_shares")
