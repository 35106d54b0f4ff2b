"""A service told its database URL is a transaction-mode pooler connects as a pooler's
client must: nothing prepared, no startup options; PgBouncer's configuration keeps
the guards those options set on a direct connection."""

from __future__ import annotations

from pathlib import Path

from services.config.sections import Settings
from services.db.repository.database import IDLE_IN_TRANSACTION_MS, _connect_args
from services.ops.pgbouncer import parse_upstream, render_config


def test_the_setting_is_read_from_the_environment() -> None:
    assert Settings.from_env({"DARKROOM_DATABASE_POOLED": "true"}).kernel.database_pooled is True
    assert Settings.from_env({}).kernel.database_pooled is False


def test_a_pooled_connection_prepares_nothing_and_sends_no_options() -> None:
    pooled, direct = _connect_args("a", pooled=True), _connect_args("a")
    assert pooled["prepare_threshold"] is None and "options" not in pooled
    assert "prepare_threshold" not in direct
    assert f"idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}" in direct["options"]
    # Everything else (autocommit, keepalives, the name) is the same.
    assert {k: v for k, v in pooled.items() if k != "prepare_threshold"} == {
        k: v for k, v in direct.items() if k != "options"
    }


def test_pgbouncers_configuration_pools_transactions_within_a_bound() -> None:
    upstream = parse_upstream("postgresql+psycopg://darkroom:pw@db.lan:5433/darkroom?sslmode=verify-full")
    config = render_config(
        upstream=upstream,
        port=6432,
        auth_file=Path("/x/userlist.txt"),
        pool_size=5,
        max_db_connections=40,
        max_client_conn=3000,
    )
    lines = set(config.splitlines())
    assert {
        "* = host=db.lan port=5433",
        "pool_mode = transaction",
        "default_pool_size = 5",
        "max_db_connections = 40",
        "max_client_conn = 3000",
        f"idle_transaction_timeout = {IDLE_IN_TRANSACTION_MS // 1000}",
        "ignore_startup_parameters = extra_float_digits,options",
        "server_tls_sslmode = verify-full",
    } <= lines
    assert (upstream.user, upstream.password, upstream.database) == ("darkroom", "pw", "darkroom")
