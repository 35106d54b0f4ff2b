"""Driver errors become Darkroom's own once, at the repository's boundary: what
a retry may fix is StoreUnavailable, what it cannot is StoreError."""

from __future__ import annotations

import psycopg
import psycopg.errors as pg
import pytest

from services.db.repository.database import translate
from services.errors import StoreError, StoreUnavailable


@pytest.mark.parametrize(
    "error",
    [
        psycopg.OperationalError("connection refused"),
        pg.AdminShutdown("terminating connection due to administrator command"),
        pg.TooManyConnections("too many clients"),
        # A connection made to the primary before a failover, which is now a standby.
        pg.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"),
        OSError("network is unreachable"),
    ],
)
def test_what_a_retry_may_fix_is_unavailable(error: BaseException) -> None:
    assert isinstance(translate(error), StoreUnavailable)


@pytest.mark.parametrize(
    "error", [pg.UniqueViolation("duplicate key"), pg.SyntaxError("syntax error"), pg.DataException("bad")]
)
def test_what_a_retry_cannot_fix_is_a_store_error(error: BaseException) -> None:
    translated = translate(error)
    assert isinstance(translated, StoreError) and not isinstance(translated, StoreUnavailable)


def test_other_exceptions_are_not_the_drivers() -> None:
    assert translate(ValueError("x")) is None
