"""Applies the Alembic migrations; every service calls this on start."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from services.backoff import Backoff

log = logging.getLogger(__name__)

# Any fixed number: it only has to differ from the scheduler's lock key.
_MIGRATION_LOCK = 0x6461726B


def sync_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url


def upgrade(database_url: str) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    engine = create_engine(sync_url(database_url), connect_args={"connect_timeout": 5})
    try:
        with engine.begin() as conn:
            # Services start together; the lock makes one of them migrate and the
            # others wait and then find nothing left to do.
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    finally:
        engine.dispose()


async def upgrade_when_reachable(database_url: str, stop: asyncio.Event, *, retry_max_s: float = 5.0) -> bool:
    """Applies the migrations, waiting for the database if it is away (a service
    started before it, or during its restart). False if ``stop`` was set first."""
    backoff = Backoff(max_s=retry_max_s)
    while not stop.is_set():
        try:
            await asyncio.to_thread(upgrade, database_url)
            return True
        except OperationalError as exc:
            log.warning("database not reachable (%s); retrying in %.1fs", exc.orig or exc, backoff.next_s)
            await backoff.wait(stop)
    return False
