"""tenants' own LoRA adapters (``tenant_adapters``): uploaded through the API into
the model store's tenants/ prefix, private to their tenant unless an operator
publishes them; and each tenant's limits on them (NULL: the gateway's defaults)

Revision ID: 0021
Revises: 0020
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_adapters",
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("name", sa.String(48), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("layers", sa.Integer, nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("skipped", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("stored", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("published", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "name", "version"),
    )
    op.create_index(
        "ix_tenant_adapters_published_name",
        "tenant_adapters",
        ["name"],
        unique=True,
        postgresql_where=sa.text("published"),
    )
    op.add_column("tenants", sa.Column("max_adapters", sa.Integer))
    op.add_column("tenants", sa.Column("max_adapter_mb", sa.Float))


def downgrade() -> None:
    op.drop_column("tenants", "max_adapter_mb")
    op.drop_column("tenants", "max_adapters")
    op.drop_index("ix_tenant_adapters_published_name", table_name="tenant_adapters")
    op.drop_table("tenant_adapters")
