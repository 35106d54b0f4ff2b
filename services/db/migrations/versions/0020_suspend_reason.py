"""why the scheduler asked a running job to suspend (with suspend_requested): a
worker that learns of it from its flag rather than the scheduler's call records the
same reason

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("suspend_reason", sa.Text, nullable=False, server_default=sa.text("''")))


def downgrade() -> None:
    op.drop_column("jobs", "suspend_reason")
