"""suspend and resume: each job's latest denoising checkpoint, which attempt wrote
it and at which step, its suspensions and resumptions, and the scheduler's request
to suspend it for other work

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("checkpoint_step", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("checkpoint_attempt", sa.Integer))
    op.add_column("jobs", sa.Column("preemptions", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("suspend_requested", sa.Boolean, nullable=False, server_default=sa.text("false")))
    op.add_column("jobs", sa.Column("suspend_log", JSONB, nullable=False, server_default=sa.text("'[]'")))
    op.add_column("jobs", sa.Column("aged_from", sa.DateTime(timezone=True)))
    op.create_table(
        "job_checkpoints",
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_checkpoints")
    op.drop_column("jobs", "aged_from")
    op.drop_column("jobs", "suspend_log")
    op.drop_column("jobs", "suspend_requested")
    op.drop_column("jobs", "preemptions")
    op.drop_column("jobs", "checkpoint_attempt")
    op.drop_column("jobs", "checkpoint_step")
