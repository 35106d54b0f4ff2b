"""The lock one ``darkroom up`` holds on its data directory while it runs: a second
``up`` on the same data is refused, naming the first; and a server found on the
data by an ``up`` that holds the lock was left by one that died (its backends are
then stopped cleanly, ``services.ops.orphans``). The kernel drops the lock with
its holder, however it dies: it is never stale, and no file needs removing."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class DataDirLocked(RuntimeError):
    pass


class DataDirLock:
    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / "run" / "up.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirLocked(
                f"another `darkroom up` (pid {holder}) is running on {self.path.parent.parent}; stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above, not the lock
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None
