"""observability and speed: when a job was published to its worker and when its
images were decoded (so that every stage has a duration), the trace it belongs to,
and an index that finds each lane's oldest queued jobs without reading the queue

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("dispatched_at", sa.DateTime(timezone=True)))
    op.add_column("jobs", sa.Column("decoded_at", sa.DateTime(timezone=True)))
    # W3C trace context of the submit: every service's spans for the job join its trace.
    op.add_column("jobs", sa.Column("trace_context", sa.String(128)))
    op.create_index(
        "ix_jobs_queued_by_lane", "jobs", ["lane", "created_at"], postgresql_where=sa.text("status = 'QUEUED'")
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_by_lane", "jobs")
    op.drop_column("jobs", "trace_context")
    op.drop_column("jobs", "decoded_at")
    op.drop_column("jobs", "dispatched_at")
