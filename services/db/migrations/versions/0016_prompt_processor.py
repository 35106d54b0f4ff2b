"""prompt processor: a job's expanded prompt and the policy its outputs are checked
under; each image's NSFW score and verdict; a tenant's output policy and whether its
prompts are expanded by default

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("expanded_prompt", sa.Text))
    op.add_column("jobs", sa.Column("output_policy", sa.String(8), nullable=False, server_default=sa.text("''")))
    op.add_column("job_images", sa.Column("nsfw_score", sa.Float))
    op.add_column("job_images", sa.Column("verdict", sa.String(8), nullable=False, server_default=sa.text("''")))
    op.add_column("tenants", sa.Column("output_policy", sa.String(8)))
    op.add_column("tenants", sa.Column("expand_prompts", sa.Boolean, nullable=False, server_default=sa.false()))


def downgrade() -> None:
    op.drop_column("tenants", "expand_prompts")
    op.drop_column("tenants", "output_policy")
    op.drop_column("job_images", "verdict")
    op.drop_column("job_images", "nsfw_score")
    op.drop_column("jobs", "output_policy")
    op.drop_column("jobs", "expanded_prompt")
