"""Presence read once, for tools and tests that need no view kept up to date (``up``
waiting for its workers, the test suites): every worker in the bucket now."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats

from services.bus.connection import BUS_ERRORS
from services.bus.credentials import NatsCredentials
from services.bus.presence_board import PresenceBoard
from services.db.states import WorkerKind
from services.db.worker_records import WorkerRecord
from services.errors import BusError
from services.presence_view import PresenceView, entry_age_s


async def read_once(nc: nats.NATS, *, stale_after_s: float, timeout_s: float = 5.0) -> list[WorkerRecord]:
    """Every worker in the presence bucket now, samplers then decoders, each marked
    live or not: for tools and tests, which need no view kept up to date."""
    view = PresenceView(tuple(WorkerKind))
    try:
        board = await PresenceBoard.open(nc.jetstream(), create=False)
    except BusError:
        return []  # no bucket yet: no worker has announced itself
    watcher = await board.watch()
    try:
        while (entry := await watcher.updates(timeout=timeout_s)) is not None:
            value = None if entry.operation in ("DEL", "PURGE") else entry.value
            view.fold(entry.key, value, age_s=entry_age_s(entry.created))
    finally:
        with contextlib.suppress(BusError, *BUS_ERRORS):
            await watcher.stop()
    return [w for kind in WorkerKind for w in view.all(kind, stale_after_s=stale_after_s)]


def presence_now(
    servers: list[str], *, credentials: NatsCredentials | None = None, stale_after_s: float = 10.0
) -> list[WorkerRecord]:
    """``read_once`` from a plain (not async) caller; raises BusError if NATS does not answer."""

    async def read() -> list[WorkerRecord]:
        sealed: dict[str, Any] = {}
        if credentials is not None:
            sealed = {
                "user": credentials.user,
                "password": credentials.password,
                "tls": credentials.tls,
                "inbox_prefix": credentials.inbox_prefix,
            }
        try:
            nc = await nats.connect(
                servers, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False, **sealed
            )
        except BUS_ERRORS as exc:
            raise BusError(f"cannot read presence: {exc}") from exc
        try:
            return await read_once(nc, stale_after_s=stale_after_s)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot read presence: {exc}") from exc
        finally:
            await nc.close()

    return asyncio.run(read())
