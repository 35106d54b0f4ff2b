"""How every service process starts and stops: settings loaded once, a stop event
set by SIGINT/SIGTERM, and ``serve(settings, stop)`` left to finish in-flight work."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from services.settings import Settings

Serve = Callable[[Settings, asyncio.Event], Awaitable[None]]


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_service(name: str, serve: Serve, settings: Settings | None = None) -> None:
    settings = settings or Settings.from_env()
    configure_logging(settings.log_level)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    try:
        asyncio.run(runner())
    except KeyboardInterrupt:
        pass
    logging.getLogger(f"darkroom.{name}").info("%s stopped", name)
