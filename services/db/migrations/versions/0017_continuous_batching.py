"""continuous batching: how many images were already running in the batch a job
joined at a step boundary (NULL: it began its batch)

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("joined_rows", sa.Integer))


def downgrade() -> None:
    op.drop_column("jobs", "joined_rows")
