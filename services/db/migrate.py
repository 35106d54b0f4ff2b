"""Applies the Alembic migrations; every service calls this on start, except one
that reaches PostgreSQL through a transaction pooler: it waits for the schema
(migrations go straight to the server, never through a pooler).

A database already at the newest revision, as it is at every start but the first,
is told so by one query: Alembic is imported and asked only where there is
something to do (importing and asking it took 0.3 s of CPU at each service's start)."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from services.backoff import Backoff
from services.db.repository.database import libpq_url

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

# Any fixed number: it only has to differ from the scheduler's lock key.
_MIGRATION_LOCK = 0x6461726B
_MIGRATIONS = Path(__file__).parent / "migrations"
# A migration's ``revision = "0007"`` and ``down_revision = "0006"`` (or None).
_REVISION_LINE = re.compile(r'^(down_)?revision(?:\s*:[^=\n]*)?\s*=\s*(?:"([^"]*)"|None)\s*$', re.M)
# What connecting may raise while the server is away: waited out by the callers.
UNREACHABLE = (OperationalError, psycopg.OperationalError)


def sync_url(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url


def alembic_config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return cfg


@functools.cache
def newest_revision() -> str | None:
    """The revision the migrations end at, read from their files; None where they do
    not end at one (a branch not yet merged), for Alembic to sort out."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (_MIGRATIONS / "versions").glob("*.py"):
        for down, revision in _REVISION_LINE.findall(path.read_text()):
            if down and revision:
                parents.add(revision)
            elif not down:
                revisions.add(revision)
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def current_revision(database_url: str) -> str | None:
    """The database's revision; None where it has no schema yet. Raises
    psycopg.OperationalError where the server cannot be reached. Nothing is
    prepared: a transaction pooler passes it."""
    with psycopg.connect(libpq_url(database_url), autocommit=True, connect_timeout=5, prepare_threshold=None) as conn:
        try:
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        except psycopg.errors.UndefinedTable:
            return None
    return str(row[0]) if row is not None else None


def upgrade(database_url: str) -> None:
    """Brings the schema to the newest revision. Raises what connecting raised where
    the server cannot be reached (one of ``UNREACHABLE``)."""
    if at_head(database_url):
        return
    from alembic import command

    cfg = alembic_config()
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
        except UNREACHABLE as exc:
            log.warning("database not reachable (%s); retrying in %.1fs", _reason(exc), backoff.next_s)
            await backoff.wait(stop)
    return False


def _reason(exc: Exception) -> object:
    return exc.orig or exc if isinstance(exc, OperationalError) else exc


def at_head(database_url: str) -> bool:
    """Whether the database's schema is the newest these migrations make (asked in
    one query, which a transaction pooler passes)."""
    head = newest_revision()
    if head is None:
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    return current_revision(database_url) == head


async def schema_when_ready(database_url: str, stop: asyncio.Event, *, retry_max_s: float = 5.0) -> bool:
    """Waits until another process has brought the schema to the newest, and the
    database answers. False if ``stop`` was set first."""
    backoff = Backoff(max_s=retry_max_s)
    while not stop.is_set():
        try:
            if await asyncio.to_thread(at_head, database_url):
                return True
            log.warning("the database's schema is not the newest yet; waiting %.1fs", backoff.next_s)
        except UNREACHABLE as exc:
            log.warning("database not reachable (%s); retrying in %.1fs", _reason(exc), backoff.next_s)
        await backoff.wait(stop)
    return False
