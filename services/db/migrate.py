"""Applies the Alembic migrations; every service calls this on start, except one
that reaches PostgreSQL through a transaction pooler: it waits for the schema
(migrations go straight to the server, never through a pooler)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from services.backoff import Backoff

log = logging.getLogger(__name__)

# Any fixed number: it only has to differ from the scheduler's lock key.
_MIGRATION_LOCK = 0x6461726B


def sync_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    return cfg


def upgrade(database_url: str) -> None:
    cfg = _config()
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


def at_head(database_url: str) -> bool:
    """Whether the database's schema is the newest these migrations make."""
    head = ScriptDirectory.from_config(_config()).get_current_head()
    engine = create_engine(sync_url(database_url), connect_args={"connect_timeout": 5, "prepare_threshold": None})
    try:
        with engine.connect() as conn:
            try:
                current = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            except ProgrammingError:
                return False  # no schema at all yet
    finally:
        engine.dispose()
    return current == head


async def schema_when_ready(database_url: str, stop: asyncio.Event, *, retry_max_s: float = 5.0) -> bool:
    """Waits until another process has brought the schema to the newest, and the
    database answers. False if ``stop`` was set first."""
    backoff = Backoff(max_s=retry_max_s)
    while not stop.is_set():
        try:
            if await asyncio.to_thread(at_head, database_url):
                return True
            log.warning("the database's schema is not the newest yet; waiting %.1fs", backoff.next_s)
        except OperationalError as exc:
            log.warning("database not reachable (%s); retrying in %.1fs", exc.orig or exc, backoff.next_s)
        await backoff.wait(stop)
    return False
