"""tenants and their API keys: every job belongs to the tenant whose key submitted
it (jobs from before, and from keys of DARKROOM_API_KEYS, to "default"), and an
idempotency key is unique within its tenant

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("lane", sa.String(32), nullable=False),
        sa.Column("credits", sa.Float),
        sa.Column("daily_credits", sa.Float),
        sa.Column("max_jobs", sa.Integer),
        sa.Column("rate_per_s", sa.Float),
        sa.Column("weight", sa.Float, nullable=False, server_default=sa.text("1")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(64), sa.ForeignKey("tenants.name", ondelete="CASCADE"), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])
    op.add_column("jobs", sa.Column("tenant", sa.String(64), nullable=False, server_default=sa.text("'default'")))
    op.drop_index("ux_jobs_idempotency_key", table_name="jobs")
    op.create_index(
        "ux_jobs_tenant_idempotency_key",
        "jobs",
        ["tenant", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_index("ix_jobs_tenant_created", "jobs", ["tenant", "created_at", "id"])
    op.create_index(
        "ix_jobs_tenant_active",
        "jobs",
        ["tenant"],
        postgresql_where=sa.text("status IN ('QUEUED','SCHEDULED','RUNNING','DECODING')"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_active", table_name="jobs")
    op.drop_index("ix_jobs_tenant_created", table_name="jobs")
    op.drop_index("ux_jobs_tenant_idempotency_key", table_name="jobs")
    op.create_index(
        "ux_jobs_idempotency_key",
        "jobs",
        ["idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.drop_column("jobs", "tenant")
    op.drop_index("ix_api_keys_tenant", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
