"""How every service process starts and stops: settings loaded once, a stop event
set by SIGINT/SIGTERM, and ``serve(settings, stop)`` left to finish in-flight work."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

from services.settings import Settings

Serve = Callable[[Settings, asyncio.Event], Awaitable[None]]


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)


def run_service(name: str, serve: Serve, settings: Settings | None = None) -> None:
    settings = settings or Settings.from_env()
    configure_logging(settings.log_level)
    # `kill -USR1 <pid>` prints every thread's stack: how to see what a stuck service waits on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR2, _dump_tasks)
        await serve(settings, stop)

    try:
        asyncio.run(runner())
    except KeyboardInterrupt:
        pass
    logging.getLogger(f"darkroom.{name}").info("%s stopped", name)
