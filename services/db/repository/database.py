"""The connection pool and the one place where driver errors become Darkroom's own."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from services.db.migrate import sync_url
from services.errors import StoreError, StoreUnavailable

# Held for the length of one scheduling or recovery pass: replicas take turns, so a
# job is placed, or recovered, by exactly one of them.
SCHEDULER_LOCK = 0x44524B53
# Held by the replica running a warm-set planning pass.
PLANNER_LOCK = 0x44524B50
# No Darkroom transaction waits on anything but the database; one idle this long
# belongs to a process that is frozen or gone.
IDLE_IN_TRANSACTION_MS = 3000
# SQLSTATE classes that mean "the server is not there right now", not "you asked
# for something wrong": connection exceptions, operator intervention (shutdown,
# crash recovery), insufficient resources.
_UNAVAILABLE_SQLSTATES = ("08", "57", "53")


class Database:
    def __init__(self, database_url: str, *, pool_size: int = 10, application_name: str = "darkroom") -> None:
        self.engine = create_async_engine(
            sync_url(database_url),
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_pre_ping=True,
            connect_args={
                "application_name": application_name[:63],
                "connect_timeout": 5,
                # A peer that vanishes (host down, cable out) is noticed on both
                # ends within seconds, so a dead replica's scheduler lock, which
                # lives as long as its transaction, does not outlive it.
                "keepalives": 1,
                "keepalives_idle": 5,
                "keepalives_interval": 2,
                "keepalives_count": 3,
                "tcp_user_timeout": 10_000,
                "options": " ".join(
                    [
                        "-c tcp_keepalives_idle=5",
                        "-c tcp_keepalives_interval=2",
                        "-c tcp_keepalives_count=3",
                        # A frozen process (SIGSTOP, a stalled VM) keeps its socket
                        # open; the server ends its transaction, and lock, after this.
                        f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}",
                    ]
                ),
            },
        )
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    async def close(self) -> None:
        await self.engine.dispose()

    @contextlib.asynccontextmanager
    async def tx(self) -> AsyncIterator[AsyncSession]:
        """One transaction; commits on success. Driver errors leave as StoreUnavailable
        (retry later) or StoreError."""
        try:
            async with self._sessions() as session, session.begin():
                yield session
        except (OperationalError, InterfaceError) as exc:
            raise StoreUnavailable(f"database unavailable: {exc.orig or exc}") from exc
        except DBAPIError as exc:
            sqlstate = getattr(exc.orig, "sqlstate", None) or ""
            if exc.connection_invalidated or sqlstate.startswith(_UNAVAILABLE_SQLSTATES):
                raise StoreUnavailable(f"database unavailable: {exc.orig or exc}") from exc
            raise StoreError(f"database error: {exc}") from exc
        except SQLAlchemyError as exc:
            raise StoreError(f"database error: {exc}") from exc
        except OSError as exc:
            raise StoreUnavailable(f"database unavailable: {exc}") from exc

    async def ping(self) -> None:
        async with self.tx() as s:
            await s.execute(text("SELECT 1"))


async def try_lock(s: AsyncSession, key: int) -> bool:
    """Takes a transaction-scoped advisory lock if it is free."""
    return bool((await s.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": key})).scalar())


async def lock(s: AsyncSession, key: int) -> None:
    """Waits for a transaction-scoped advisory lock."""
    await s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
