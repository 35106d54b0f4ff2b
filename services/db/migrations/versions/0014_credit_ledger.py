"""credit ledger: a tenant's balance apart from what its open jobs hold, and each
movement of it (credit_entries); an index of each tenant's unsettled jobs

Until now a tenant's credits column held what it could still reserve: its open
jobs' reservations were taken out of it, and given back at settlement. From here
it holds the balance, and the reservations are held apart: each tenant with a
limit gets back what its open jobs hold, and an opening entry for the balance.
A tenant without a limit reserves nothing: its open jobs' reservations go.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_HELD = """
SELECT tenant, sum(credits_reserved) AS held FROM jobs WHERE settled_at IS NULL GROUP BY tenant
"""


def upgrade() -> None:
    op.create_table(
        "credit_entries",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("amount", sa.Float, nullable=False),
        sa.Column("job_id", sa.String(36)),
    )
    op.create_index("ix_credit_entries_tenant_at", "credit_entries", ["tenant", "at"])
    op.create_index("ix_jobs_tenant_unsettled", "jobs", ["tenant"], postgresql_where=sa.text("settled_at IS NULL"))
    op.execute(
        """
        UPDATE jobs SET credits_reserved = 0
        WHERE settled_at IS NULL AND credits_reserved <> 0
          AND tenant NOT IN (SELECT name FROM tenants WHERE credits IS NOT NULL)
        """
    )
    op.execute(
        f"""
        UPDATE tenants t SET credits = t.credits + h.held
        FROM ({_HELD}) h WHERE t.name = h.tenant AND t.credits IS NOT NULL
        """
    )
    op.execute(
        """
        INSERT INTO credit_entries (tenant, at, kind, amount)
        SELECT name, now(), 'initial', credits FROM tenants WHERE credits IS NOT NULL AND credits <> 0
        """
    )


def downgrade() -> None:
    op.execute(
        f"""
        UPDATE tenants t SET credits = t.credits - h.held
        FROM ({_HELD}) h WHERE t.name = h.tenant AND t.credits IS NOT NULL
        """
    )
    op.drop_index("ix_jobs_tenant_unsettled", table_name="jobs")
    op.drop_index("ix_credit_entries_tenant_at", table_name="credit_entries")
    op.drop_table("credit_entries")
