"""Connections to PostgreSQL, and the one place where driver errors become
Darkroom's own.

Plain psycopg 3 with SQL written out: a statement costs about 0.1 ms of the
caller's CPU this way, against 0.7 ms through SQLAlchemy's asyncio layer, and at a
thousand jobs a second that is the difference between carrying the load and being
it. Connections are in autocommit mode, so a single statement is one round trip;
``tx()`` wraps several in a transaction. Each connection prepares the statements it
runs often (psycopg does it after a few executions), unless it is ``pooled``:
through PgBouncer in transaction mode (services.ops.pgbouncer), where a server
connection is another client's between transactions, it prepares nothing and sends
no startup options (PgBouncer keeps those guards itself)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import AsyncConnection, AsyncCursor
from psycopg.pq import TransactionStatus
from psycopg.rows import DictRow, dict_row

from services.errors import StoreError, StoreUnavailable
from services.telemetry.metrics import DB_STATEMENTS

# Held for the length of one scheduling or recovery pass: replicas take turns, so a
# job is placed, or recovered, by exactly one of them.
SCHEDULER_LOCK = 0x44524B53
# Held by the replica running a warm-set planning pass.
PLANNER_LOCK = 0x44524B50
# No Darkroom transaction waits on anything but the database; one idle this long
# belongs to a process that is frozen or gone.
IDLE_IN_TRANSACTION_MS = 3000
# SQLSTATEs that mean "the server is not there right now", not "you asked for
# something wrong": the classes of connection exceptions, operator intervention
# (shutdown, crash recovery) and insufficient resources; and a write refused as
# read-only, by a server that was the primary when the connection was made and is
# a standby since a failover (the next connection finds the writable one).
_UNAVAILABLE_SQLSTATES = ("08", "57", "53", "25006")

Params = Mapping[str, Any] | Sequence[Any] | None
Row = DictRow


def libpq_url(database_url: str) -> str:
    """The URL as libpq reads it: without SQLAlchemy's ``+psycopg`` driver suffix."""
    return database_url.replace("postgresql+psycopg://", "postgresql://", 1)


class _CountedCursor(AsyncCursor[Any]):
    """A cursor that counts the statements it sends (``darkroom_db_statements_total``):
    every query of the repository goes through one."""

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        DB_STATEMENTS.inc()
        return await super().execute(*args, **kwargs)

    async def executemany(self, *args: Any, **kwargs: Any) -> None:
        DB_STATEMENTS.inc()
        await super().executemany(*args, **kwargs)


def _connect_args(application_name: str, *, pooled: bool = False) -> dict[str, Any]:
    args: dict[str, Any] = {
        "autocommit": True,
        "row_factory": dict_row,
        "cursor_factory": _CountedCursor,
        "application_name": application_name[:63],
        "connect_timeout": 5,
        # A peer that vanishes (host down, cable out) is noticed on both ends within
        # seconds, so a dead replica's scheduler lock, which lives as long as its
        # transaction, does not outlive it.
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": 10_000,
    }
    if pooled:
        # A prepared statement lives in one server connection, and the next
        # transaction may get another; the server-side guards below are the
        # pooler's own settings there (services.ops.pgbouncer).
        return {**args, "prepare_threshold": None}
    return {
        **args,
        "options": " ".join(
            [
                "-c tcp_keepalives_idle=5",
                "-c tcp_keepalives_interval=2",
                "-c tcp_keepalives_count=3",
                # A frozen process (SIGSTOP, a stalled VM) keeps its socket open; the
                # server ends its transaction, and lock, after this.
                f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
            ]
        ),
    }


def translate(exc: BaseException) -> StoreError | None:
    """The Darkroom error for a driver error; None if it is not one."""
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError | OSError):
        return StoreUnavailable(f"database unavailable: {exc}")
    if isinstance(exc, psycopg.Error):
        if (exc.sqlstate or "").startswith(_UNAVAILABLE_SQLSTATES):
            return StoreUnavailable(f"database unavailable: {exc}")
        return StoreError(f"database error: {exc}")
    return None


class Database:
    """A small pool of connections, opened on demand: a service started before the
    database, or during its restart, gets StoreUnavailable at once rather than a
    wait, and its loop retries."""

    def __init__(
        self, database_url: str, *, pool_size: int = 10, application_name: str = "darkroom", pooled: bool = False
    ) -> None:
        self.url = libpq_url(database_url)
        self.pool_size = pool_size
        self.pooled = pooled
        self._connect_args = _connect_args(application_name, pooled=pooled)
        self._idle: list[AsyncConnection[DictRow]] = []
        # At most twice the pool in use at once; the rest wait for one to come back.
        self._slots = asyncio.Semaphore(pool_size * 2)
        self._closed = False

    async def _acquire(self) -> AsyncConnection[DictRow]:
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed and not conn.broken:
                    return conn
            return await AsyncConnection.connect(self.url, **self._connect_args)
        except BaseException:
            self._slots.release()
            raise

    async def _release(self, conn: AsyncConnection[DictRow], *, healthy: bool) -> None:
        try:
            reusable = (
                healthy
                and not self._closed
                and not conn.broken
                and not conn.closed
                and conn.info.transaction_status == TransactionStatus.IDLE
                and len(self._idle) < self.pool_size
            )
            if reusable:
                self._idle.append(conn)
            else:
                with contextlib.suppress(psycopg.Error, OSError):
                    await conn.close()
        finally:
            self._slots.release()

    async def _discard_idle(self) -> None:
        """After the server went away every idle connection is dead too."""
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection[DictRow]]:
        """A connection in autocommit mode. Driver errors leave as StoreUnavailable
        (retry later) or StoreError."""
        try:
            conn = await self._acquire()
        except BaseException as exc:
            raise _translated(exc) from exc
        healthy = False
        try:
            yield conn
            healthy = True
        except BaseException as exc:
            error = translate(exc)
            if isinstance(error, StoreUnavailable):
                await self._discard_idle()
            if error is not None:
                raise error from exc
            raise
        finally:
            await self._release(conn, healthy=healthy)

    @contextlib.asynccontextmanager
    async def tx(self) -> AsyncIterator[AsyncConnection[DictRow]]:
        """A connection inside one transaction, committed when the block ends."""
        async with self.connection() as conn, conn.transaction():
            yield conn

    async def all(self, sql: str, params: Params = None) -> list[Row]:
        async with self.connection() as conn:
            return await (await conn.execute(sql, params)).fetchall()

    async def one(self, sql: str, params: Params = None) -> Row | None:
        async with self.connection() as conn:
            return await (await conn.execute(sql, params)).fetchone()

    async def run(self, sql: str, params: Params = None) -> int:
        """Runs a statement; returns how many rows it changed."""
        async with self.connection() as conn:
            return (await conn.execute(sql, params)).rowcount

    async def close(self) -> None:
        self._closed = True
        await self._discard_idle()


class Area:
    """One area of the repository (jobs, attempts, workers, ...): its queries over
    the shared database."""

    def __init__(self, db: Database) -> None:
        self.db = db


def _translated(exc: BaseException) -> BaseException:
    error = translate(exc)
    return error if error is not None else exc


async def fetch_all(conn: AsyncConnection[DictRow], sql: str, params: Params = None) -> list[Row]:
    return await (await conn.execute(sql, params)).fetchall()


async def fetch_one(conn: AsyncConnection[DictRow], sql: str, params: Params = None) -> Row | None:
    return await (await conn.execute(sql, params)).fetchone()


async def try_lock(conn: AsyncConnection[DictRow], key: int) -> bool:
    """Takes a transaction-scoped advisory lock if it is free."""
    row = await fetch_one(conn, "SELECT pg_try_advisory_xact_lock(%s) AS locked", (key,))
    return bool(row and row["locked"])


async def lock(conn: AsyncConnection[DictRow], key: int) -> None:
    """Waits for a transaction-scoped advisory lock."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
