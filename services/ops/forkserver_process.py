"""The fork server's own process (services/ops/forkserver.py is the supervisor's
side): imports what it is told to, then forks a child per request on stdin (a unix
socket), answering its pid, and reports each child's exit, on stdout. A forked
child makes itself what a new process of its own would have been (a session, its
environment, its log on stdout and stderr, its title, death with the server as the
server's with the supervisor), then runs its service's ``__main__``.

A request's environment comes as a descriptor beside it, which the server gives
the child and closes unread: only the child reads it, after the fork, so the
server's memory, which every later child is a copy of, holds no child's settings."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from typing import Any

import setproctitle

log = logging.getLogger(__name__)


def _preload(names: list[str]) -> None:
    for name in names:
        module_name, _, attributes = name.partition(":")
        try:
            module = importlib.import_module(module_name)
            for attribute in filter(None, attributes.split(",")):
                getattr(module, attribute)
        except Exception:  # not installed here: a child that needs it imports it itself
            log.warning("fork server: could not preload %s", name, exc_info=True)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_child(request: dict[str, Any], given: int, server_pid: int, close: list[int]) -> None:
    """In the forked child: becomes the process ``python -m module`` would have been
    (a session of its own, its environment, read from ``given``, and output, default
    signal handling), then runs it. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        # Dies with the server, as the server does with the supervisor: no orphan serves on.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0 or os.getppid() != server_pid:  # 1: PR_SET_PDEATHSIG
            os._exit(1)
        out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in (out, null, *close):
            os.close(fd)
        with os.fdopen(given, "rb") as environment:
            env: dict[str, str] = json.load(environment)
        # Named in ps, psutil and pkill as a new process would be: ``python -m module``
        # (before the environment changes: setproctitle finds the arguments' memory by it).
        setproctitle.setproctitle(f"{sys.executable} -m {request['module']}")
        libc.prctl(15, os.path.basename(sys.executable).encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME, top's name
        os.environ.clear()
        os.environ.update(env)
        random.seed()  # not the server's sequence, shared by every child
        # torch read the server's OMP_NUM_THREADS when the server imported it (a
        # child that imports it itself reads its own).
        threads, torch = env.get("OMP_NUM_THREADS", ""), sys.modules.get("torch")
        if threads.isdigit() and torch is not None:
            torch.set_num_threads(int(threads))
        sys.argv = [request["module"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(preload: list[str]) -> None:
    """Imports ``preload``, then forks a child per request on stdin, answering its
    pid, and reports each child's exit, on stdout."""
    gc.disable()
    _preload(preload)
    # What the imports made lives as long as every child: set aside, so that no
    # child's collections traverse it and copy its pages (lifecycle.imports_done).
    gc.freeze()
    gc.enable()
    requests = socket.socket(fileno=os.dup(0))
    answers = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # what the server itself prints goes to its log
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if threading.active_count() > 1:
        log.warning("fork server: %d threads after the imports", threading.active_count())
    reaped, woken = os.pipe()
    os.set_blocking(woken, False)
    os.set_blocking(reaped, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ, "request")
    selector.register(reaped, selectors.EVENT_READ, "reaped")
    server_pid = os.getpid()

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message).encode() + b"\n")

    while True:
        for key, _ in selector.select():
            if key.data == "reaped":
                with contextlib.suppress(BlockingIOError):
                    os.read(reaped, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    answer({"exited": pid, "code": _exit_code(status)})
                continue
            message, fds, _, _ = socket.recv_fds(requests, 65536, 1)
            if not message:  # the supervisor is done with it
                return
            request = json.loads(message)
            if not fds:  # the kernel drops a descriptor this process has no room for (EMFILE)
                answer({"id": request["id"], "error": "its environment did not arrive"})
                continue
            given = fds[0]
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(given)
                answer({"id": request["id"], "error": str(exc)})
                continue
            if pid == 0:
                closed = [requests.fileno(), answers.fileno(), reaped, woken, selector.fileno()]
                _run_child(request, given, server_pid, closed)
            os.close(given)  # the child's to read: no later child inherits it
            answer({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    serve(sys.argv[1:])
