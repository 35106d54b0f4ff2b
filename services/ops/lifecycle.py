"""How every service process starts and stops: settings loaded once, a stop event
set by SIGINT/SIGTERM, ``serve(settings, stop)`` left to finish in-flight work, and,
under a supervisor, a liveness file touched from the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from services.config.fields import Section, SettingsError
from services.config.sections import KernelSettings
from services.telemetry import logs, tracing
from services.telemetry.tenant_metrics import TENANT_LABELS

# serve() returns it when the process is not fit to go on (a worker whose attempts
# keep failing, one whose id another process took): its supervisor restarts it.
EXIT_UNFIT = 3
# A setting that cannot be used: restarting will not help.
EXIT_BAD_SETTINGS = 2

T = TypeVar("T")
S = TypeVar("S", bound=Section)
# A service's serve(): the kernel's settings and its own, until ``stop`` is set.
Serve = Callable[[KernelSettings, S, asyncio.Event], Awaitable[int | None]]


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)


async def show_alive(path: Path, every_s: float) -> None:
    """Touches ``path`` while the event loop turns: a hung loop (or a stopped
    process) stops touching it, and the supervisor notices."""
    while True:
        with contextlib.suppress(OSError):
            os.utime(path)
        await asyncio.sleep(every_s)


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Runs ``main`` on uvloop where it is installed (Linux, macOS): the same asyncio,
    with a loop written in C, which every service spends much of its time in."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def imports_done() -> None:
    """Ends a service's start without the garbage collector: what its imports made
    (modules, classes, functions: a million objects for torch and diffusers) lives as
    long as the process, so it is set aside (``gc.freeze``) rather than traversed by
    every full collection from now on, and collection resumes. A service's
    ``__main__`` turns the collector off before its first import: collecting while
    importing found nothing to free and took a fifth of a sampler's or a decoder's
    start (docs/benchmarks.md)."""
    gc.freeze()
    gc.enable()


def run_service(name: str, serve: Serve[S], section: type[S]) -> None:
    """Runs service ``name`` in this process: its settings (the kernel's and its
    ``section``) from the environment, logging, tracing, liveness, and
    ``serve`` until SIGINT or SIGTERM."""
    imports_done()
    logger = logging.getLogger(__name__)
    try:
        settings = KernelSettings.from_env()
        own = section.from_env()
    except SettingsError as exc:
        logs.configure("INFO", service=name)
        logger.error("%s", exc)
        sys.exit(EXIT_BAD_SETTINGS)
    logs.configure(settings.log_level, service=name, fmt=settings.log_format)
    TENANT_LABELS.limit = settings.tenant_metrics_max
    # `kill -USR1 <pid>` prints every thread's stack: how to see what a stuck service waits on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    liveness = Path(settings.liveness_file) if settings.liveness_file else None
    if liveness is not None:
        liveness.touch()

    async def runner() -> int | None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR2, _dump_tasks)
        alive = None
        if liveness is not None:
            alive = asyncio.create_task(show_alive(liveness, every_s=1.0))
        try:
            return await serve(settings, own, stop)
        finally:
            if alive is not None:
                alive.cancel()

    tracing.start(name, settings)
    code: int | None = 0
    try:
        code = run_loop(runner())
    except KeyboardInterrupt:
        pass
    except SettingsError as exc:  # found while starting (the gateway's open access check)
        logger.error("%s", exc)
        code = EXIT_BAD_SETTINGS
    finally:
        tracing.stop()  # the spans of the last jobs leave before the process does
    logger.info("%s stopped (pid %d)", name, os.getpid())
    sys.exit(code or 0)
