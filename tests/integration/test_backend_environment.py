"""The backends `darkroom up` starts (PostgreSQL, nats-server, PgBouncer) are given
their PATH, locale and time zone of its environment, none of its settings: started
from a process that holds DARKROOM_API_KEYS (as `DARKROOM_API_KEYS=… darkroom up`
does), the running server's /proc/<pid>/environ, readable by its user, holds no
DARKROOM_* variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.ops.embedded import EmbeddedPostgres
from services.ops.embedded_nats import EmbeddedNats
from services.ops.orphans import command_name
from services.ops.pgbouncer import PGBOUNCER_BIN, PgBouncer
from services.ops.processes import ManagedProcess
from tests.needs import require

pytestmark = pytest.mark.integration

MARKER = "dr_live_marker-key-of-the-operator"


@pytest.fixture
def keys_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DARKROOM_API_KEYS", f"tenant-a:{MARKER}")
    monkeypatch.setenv("LANG", "C.UTF-8")


def environment_of(server: ManagedProcess, command: str) -> dict[str, str]:
    """The environment of the running server, read as its user could read it."""
    assert server.proc is not None and server.running
    pid = server.proc.pid
    assert command_name(pid) == command  # the server itself, past any wrapper's exec
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


def assert_given_no_settings(env: dict[str, str]) -> None:
    assert MARKER not in "\0".join(f"{k}={v}" for k, v in env.items())
    assert [k for k in env if k.startswith("DARKROOM_")] == []
    assert env.get("LANG") == "C.UTF-8" and env.get("PATH")  # what it does read is kept


@pytest.mark.usefixtures("keys_in_environment")
def test_postgres_is_given_none_of_the_settings(tmp_path: Path) -> None:
    server = EmbeddedPostgres(tmp_path, durable=False)
    server.start()
    try:
        assert_given_no_settings(environment_of(server, "postgres"))
    finally:
        server.stop()
        server.discard()


@pytest.mark.usefixtures("keys_in_environment")
def test_nats_server_is_given_none_of_the_settings(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path)
    server.start()
    try:
        assert_given_no_settings(environment_of(server, "nats-server"))
    finally:
        server.stop()


@pytest.mark.usefixtures("keys_in_environment")
def test_pgbouncer_is_given_none_of_the_settings(tmp_path: Path, postgres: EmbeddedPostgres) -> None:
    require("" if Path(PGBOUNCER_BIN).exists() else f"no pgbouncer at {PGBOUNCER_BIN} (apt-get install pgbouncer)")
    bouncer = PgBouncer(tmp_path, postgres.url, pool_size=1)
    bouncer.start()
    try:
        assert_given_no_settings(environment_of(bouncer, "pgbouncer"))
    finally:
        bouncer.stop()
