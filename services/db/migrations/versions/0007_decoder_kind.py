"""one name per worker kind: decoders are stored as "decoder" (they were "vae")

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE workers SET kind = 'decoder' WHERE kind = 'vae'")


def downgrade() -> None:
    op.execute("UPDATE workers SET kind = 'vae' WHERE kind = 'decoder'")
