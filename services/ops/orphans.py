"""Backends a killed ``darkroom up`` left running, found and stopped cleanly by the
next ``up`` on the same data directory, before it starts its own. Only ``up``
calls these, holding the data directory's lock (``services.ops.data_lock``): a
server on its data then belongs to no live ``up``. Each process is named by what
the kernel says of it (/proc), never by a file alone: a pid in a stale
postmaster.pid may since be another process's. Nothing on disk is removed: a
PostgreSQL stopped so removes its own postmaster.pid."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and waiting for a parent's wait, does not)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        if PROC.joinpath("self").exists():
            return False
        try:  # no /proc here: whether it exists is all there is to know
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def command_name(pid: int) -> str | None:
    """The process's name as the kernel keeps it (``postgres``, ``nats-server``), or None."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return None


def working_directory(pid: int) -> Path | None:
    """Where the process works (a postmaster: its data directory), or None where
    that cannot be read (another user's process, without root)."""
    try:
        return Path(os.readlink(PROC / str(pid) / "cwd"))
    except OSError:
        return None


def stop_postmaster(pid: int, pgdata: Path, *, timeout: float = 60.0) -> None:
    """Stops the postmaster ``pid`` of ``pgdata`` with SIGINT (PostgreSQL's fast
    shutdown: clients rolled back, a checkpoint, its pid file removed) and waits
    for it to exit; raises, signalling nothing, where ``pid`` is not shown to be
    that postmaster."""
    where = working_directory(pid)
    if command_name(pid) != "postgres" or where is None or where.resolve() != pgdata.resolve():
        raise RuntimeError(
            f"{pgdata}/postmaster.pid names process {pid}, which runs but is not shown to be this cluster's "
            f"PostgreSQL (it works in {where}); stop it, or remove that file if no PostgreSQL runs on {pgdata}"
        )
    log.warning("stopping PostgreSQL (pid %d) left running on %s by a `darkroom up` that died", pid, pgdata)
    _signal_and_wait(pid, signal.SIGINT, timeout, f"PostgreSQL (pid {pid}) on {pgdata}")


def nats_servers_of(config_path: Path) -> list[int]:
    """The nats-servers running with ``config_path`` (as EmbeddedNats starts them)."""
    wanted = str(config_path).encode()
    found = []
    for entry in PROC.glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in argv and (command_name(int(entry.name)) or "").startswith("nats-server"):
            found.append(int(entry.name))
    return [pid for pid in found if alive(pid)]


def stop_nats_servers(config_path: Path, *, timeout: float = 30.0) -> None:
    """Stops (SIGTERM) every nats-server left running on ``config_path``'s store."""
    for pid in nats_servers_of(config_path):
        log.warning("stopping nats-server (pid %d) left running on %s by a `darkroom up` that died", pid, config_path)
        _signal_and_wait(pid, signal.SIGTERM, timeout, f"nats-server (pid {pid})")


def _signal_and_wait(pid: int, sig: signal.Signals, timeout: float, what: str) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not stop within {timeout:.0f}s of {sig.name}")
        time.sleep(0.05)
