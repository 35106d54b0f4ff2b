"""gpu services: the output format a job asked for, and the batch a run time was measured in

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("output_format", sa.String(8), nullable=False, server_default=sa.text("'png'")))
    # Images in the batch the job ran in (its own and its batch-mates'): the shape
    # its run time is learned under.
    op.add_column("jobs", sa.Column("batch_rows", sa.Integer))


def downgrade() -> None:
    op.drop_column("jobs", "batch_rows")
    op.drop_column("jobs", "output_format")
