"""File locks between the samplers of one host (separate processes): ``flock`` on a
lock file, taken without blocking the event loop (tried again every few
milliseconds, so a waiting task can be cancelled)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

POLL_S = 0.05


def try_lock(fd: int, *, shared: bool = False) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


async def acquire(path: Path, *, shared: bool = False) -> int:
    """An open descriptor of ``path`` holding the lock; closing it releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            if try_lock(fd, shared=shared):
                break
            await asyncio.sleep(POLL_S)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.asynccontextmanager
async def locked(path: Path, *, shared: bool = False) -> AsyncIterator[None]:
    fd = await acquire(path, shared=shared)
    try:
        yield
    finally:
        os.close(fd)


def lock_now(path: Path, *, shared: bool = False) -> int | None:
    """The lock if it is free now, else None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        return None
    if try_lock(fd, shared=shared):
        return fd
    os.close(fd)
    return None
