"""files reader: SELECT on jobs and job_images, and nothing else, for the role
darkroom_files where it exists: what the HTTP tier needs to serve signed links to
results (http_api/routes.py, Api.file), and all it holds on Kubernetes
(infra/k8s/base/postgres.yaml makes the role at the cluster's creation, before any
migration; CloudNativePG gives it its login and password). Elsewhere (the embedded
PostgreSQL, a fleet's own) there is no such role, and nothing changes.

Revision ID: 0015
Revises: 0014
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

FILES_READER = "darkroom_files"
_TABLES = "jobs, job_images"


def _where_the_role_exists(statement: str) -> str:
    return (
        f"DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{FILES_READER}') THEN "
        f"{statement}; END IF; END $$"
    )


def upgrade() -> None:
    op.execute(_where_the_role_exists(f"GRANT SELECT ON {_TABLES} TO {FILES_READER}"))


def downgrade() -> None:
    op.execute(_where_the_role_exists(f"REVOKE SELECT ON {_TABLES} FROM {FILES_READER}"))
