"""admin actions: who created or changed a tenant, or made or revoked a key, and when

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admin_actions",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(32)),
        sa.Column("detail", sa.Text, nullable=False, server_default=sa.text("''")),
    )
    op.create_index("ix_admin_actions_tenant_at", "admin_actions", ["tenant", "at"])


def downgrade() -> None:
    op.drop_index("ix_admin_actions_tenant_at", table_name="admin_actions")
    op.drop_table("admin_actions")
