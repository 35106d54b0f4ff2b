"""LoRA adapters: each job's, as [{"name", "version", "scale"}, ...] in the order
it named them (empty: none)

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("adapters", JSONB, nullable=False, server_default=sa.text("'[]'")))


def downgrade() -> None:
    op.drop_column("jobs", "adapters")
