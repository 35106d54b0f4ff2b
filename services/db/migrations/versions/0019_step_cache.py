"""step caching: how many steps of each of a job's images reused a prediction
(NULL: its model caches no steps)

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("cached_steps", sa.Integer))


def downgrade() -> None:
    op.drop_column("jobs", "cached_steps")
