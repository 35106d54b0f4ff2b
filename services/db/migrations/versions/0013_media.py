"""media: a job's frames, fps, strength, task, previews and input digests; its input image and mask
in job_inputs; the capabilities a worker serves

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("frames", sa.Integer, nullable=False, server_default=sa.text("1")))
    op.add_column("jobs", sa.Column("fps", sa.Float, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("strength", sa.Float, nullable=False, server_default=sa.text("1")))
    op.add_column("jobs", sa.Column("task", sa.String(16), nullable=False, server_default=sa.text("'text_to_image'")))
    op.add_column("jobs", sa.Column("previews", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("image_digest", sa.String(64), nullable=False, server_default=sa.text("''")))
    op.add_column("jobs", sa.Column("mask_digest", sa.String(64), nullable=False, server_default=sa.text("''")))
    op.create_table(
        "job_inputs",
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("image", sa.LargeBinary, nullable=False),
        sa.Column("mask", sa.LargeBinary),
    )
    op.add_column("workers", sa.Column("capabilities", JSONB, nullable=False, server_default=sa.text("'[]'")))


def downgrade() -> None:
    op.drop_column("workers", "capabilities")
    op.drop_table("job_inputs")
    for column in ("mask_digest", "image_digest", "previews", "task", "strength", "fps", "frames"):
        op.drop_column("jobs", column)
