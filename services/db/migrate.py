"""Applies the Alembic migrations; every service calls this on start."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text

# Any fixed number: it only has to differ from the scheduler's lock key.
_MIGRATION_LOCK = 0x6461726B


def sync_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url


def upgrade(database_url: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    engine = create_engine(sync_url(database_url))
    try:
        with engine.begin() as conn:
            # Services start together; the lock makes one of them migrate and the
            # others wait and then find nothing left to do.
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    finally:
        engine.dispose()
