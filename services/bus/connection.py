"""The connection to NATS every service shares: it reconnects on its own, forever,
once made, and says so in the log."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
from nats.errors import Error as NatsError

from services.backoff import Backoff
from services.bus.credentials import NatsCredentials
from services.errors import BusError
from services.telemetry.metrics import BUS_MESSAGES

log = logging.getLogger(__name__)

PING_INTERVAL_S = 3
# Errors that mean "NATS cannot do it right now" on any call.
BUS_ERRORS = (NatsError, OSError, TimeoutError)


async def connect_nats(
    servers: list[str],
    *,
    name: str,
    credentials: NatsCredentials | None = None,
    stop: asyncio.Event | None = None,
    retry_max_s: float = 5.0,
) -> nats.NATS:
    """A connection to NATS that reconnects on its own, forever, once made; retries
    the first connect with backoff until NATS answers (or ``stop`` is set). With
    ``credentials`` (a sealed mesh): over TLS, as that user, with its own inbox."""
    backoff = Backoff(max_s=retry_max_s)
    sealed: dict[str, Any] = {}
    disconnected = _log_disconnected
    if credentials is not None:

        async def disconnected() -> None:
            await _log_disconnected()
            if credentials.reload_if_renewed():
                log.info("NATS: reconnecting with a renewed certificate")

        sealed = {
            "user": credentials.user,
            "password": credentials.password,
            "tls": credentials.tls,
            "inbox_prefix": credentials.inbox_prefix,
        }
    while True:
        try:
            connection = await nats.connect(
                servers,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                # A server cut off (a partition, not a closed socket) is noticed
                # within three pings, and the connection moves to another node;
                # the default (two minutes a ping) would leave it waiting for minutes.
                ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=2,
                drain_timeout=5,
                error_cb=_log_error,
                **sealed,
                disconnected_cb=disconnected,
                reconnected_cb=_log_reconnected,
            )
            BUS_MESSAGES.watch(connection)
            return connection
        except BUS_ERRORS as exc:
            if stop is not None and stop.is_set():
                raise BusError(f"cannot connect to NATS at {','.join(servers)}: {exc}") from exc
            log.warning("NATS at %s not ready (%s); retrying in %.1fs", ",".join(servers), exc, backoff.next_s)
            await backoff.wait()


async def _log_error(exc: Exception) -> None:
    log.warning("NATS: %s", exc)


async def _log_disconnected() -> None:
    log.warning("NATS: disconnected; reconnecting")


async def _log_reconnected() -> None:
    log.info("NATS: reconnected")
