"""a tenant's rate bucket: the submits it held, and when, shared by every gateway

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("rate_tokens", sa.Float, nullable=False, server_default=sa.text("0")))
    op.add_column("tenants", sa.Column("rate_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("tenants", "rate_at")
    op.drop_column("tenants", "rate_tokens")
