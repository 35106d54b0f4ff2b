"""A host's fork server: one process that imports what a sampler and a decoder
import (torch, diffusers, transformers, onnxruntime: most of what each spends
starting, docs/benchmarks.md) once, and forks each of them from there. A
supervisor restarting a crashed sampler, and a test suite starting stacks by the
dozen, then pay for a fork instead of the imports.

The supervisor's side is ``ForkServer``: it starts the server on its first
request, asks it for children over the server's stdin and reads their pids and
their exits from its stdout (``ForkedProcess``, the part of ``subprocess.Popen``
the supervisor uses). A forked child is the server's: it sets up what a new
process of its own would have (a session, its environment, its log on stdout and
stderr, death with the server as the server's with the supervisor) and runs its
service's ``__main__``.

Only what the imports do not read may differ between the children and the
server: the ``DARKROOM_*`` settings (read when a service starts) and the
variables in ``PER_CHILD``. A child whose environment differs in anything else
(a variable torch reads when it is imported) is not forked from this server but
started as a new process (``compatible``).

Hosts with a GPU do not use it (``children.host_children``): whether importing
torch and diffusers touches the CUDA driver, which a forked child cannot use
again, is not measured on a GPU yet."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import setproctitle

from services.config.fields import ENV_PREFIX
from services.ops.processes import dying_with_parent, spawn

log = logging.getLogger(__name__)

# What the server imports before it forks: the services' modules, and what they
# import when they load a model (``module:attribute,...``: diffusers' and
# transformers' lazy modules import theirs when an attribute is asked for).
PRELOAD = (
    "gpu_worker.service",
    "vae_worker.service",
    "diffusers:AutoencoderKL,UNet2DConditionModel,FlowMatchEulerDiscreteScheduler",
    "transformers:CLIPTextModel,CLIPTokenizer",
)
# Variables a child may have of its own: read when it starts, not when it is imported.
# torch's thread count is read when torch is imported; a child sets it from
# OMP_NUM_THREADS itself (``_run_child``).
PER_CHILD = frozenset({"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED"})
START_TIMEOUT_S = 180.0


def per_child(name: str) -> bool:
    return name.startswith(ENV_PREFIX) or name in PER_CHILD


def shared_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` the server itself runs with: all but what each child has of its own."""
    return {k: v for k, v in env.items() if not per_child(k)}


class ForkedProcess:
    """A child of the fork server, as the supervisor sees it: ``subprocess.Popen``'s
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate`` and
    ``kill``. Its exit is reported by the server (it is the server's to reap)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The supervisor's side: one server per supervisor, started on the first request
    (with the environment of that request, less what is ``per_child``) and again
    after it died."""

    def __init__(self, log_path: Path, *, preload: tuple[str, ...] = PRELOAD) -> None:
        self.log_path = log_path
        self.preload = preload
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}
        self._asked: dict[int, Future[ForkedProcess]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._next_id = 0

    def compatible(self, env: Mapping[str, str]) -> bool:
        """Whether a child of ``env`` can be forked from this server (or the server
        is yet to start): its environment differs only in what is ``per_child``."""
        with self._lock:
            return self._proc is None or self._proc.poll() is not None or shared_env(env) == self._env

    def fork(self, module: str, env: Mapping[str, str], log_path: Path) -> ForkedProcess:
        """``python -m module`` with ``env``, its output appended to ``log_path``, forked."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start(env)
            assert self._proc is not None and self._proc.stdin is not None
            self._next_id += 1
            asked: Future[ForkedProcess] = Future()
            self._asked[self._next_id] = asked
            request = {"id": self._next_id, "module": module, "env": dict(env), "log": str(log_path)}
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        return asked.result(START_TIMEOUT_S)

    def _start(self, env: Mapping[str, str]) -> None:
        self._env = shared_env(env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self._proc = spawn(
                dying_with_parent([sys.executable, "-m", __name__, *self.preload], signal.SIGKILL),
                env={**self._env, "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                start_new_session=True,
            )
        threading.Thread(target=self._read, args=(self._proc,), name="darkroom-forkserver", daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            if "exited" in message:
                child = self._children.pop(message["exited"], None)
                if child is not None:
                    child._exit(message["code"])
                continue
            asked = self._asked.pop(message["id"])
            if "error" in message:
                asked.set_exception(RuntimeError(f"the fork server could not start it: {message['error']}"))
            else:
                child = ForkedProcess(message["pid"])
                self._children[child.pid] = child
                asked.set_result(child)
        # The server is gone, and its children with it (their parent-death signal).
        proc.wait()
        with self._lock:
            for asked in self._asked.values():
                asked.set_exception(RuntimeError(f"the fork server exited with {proc.returncode}"))
            self._asked.clear()
            children, self._children = self._children, {}
        for child in children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                _wait_gone(child.pid, timeout=5.0)
            child._exit(-signal.SIGKILL)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the server (its children, still running, die with it)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and _state(pid) not in ("Z", "X"):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(f"pid {pid}", timeout)
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


# The server's side.


def _preload(names: list[str]) -> None:
    import importlib

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


def _run_child(request: dict[str, Any], server_pid: int, close: list[int]) -> None:
    """In the forked child: becomes the process ``python -m module`` would have been
    (a session of its own, its environment and output, default signal handling),
    then runs it. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        import ctypes

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
        # Named in ps, psutil and pkill as a new process would be: ``python -m module``
        # (before the environment changes: setproctitle finds the arguments' memory by it).
        setproctitle.setproctitle(f"{sys.executable} -m {request['module']}")
        libc.prctl(15, os.path.basename(sys.executable).encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME, top's name
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # not the server's sequence, shared by every child
        # torch read the server's OMP_NUM_THREADS when the server imported it (a
        # child that imports it itself reads its own).
        threads, torch = request["env"].get("OMP_NUM_THREADS", ""), sys.modules.get("torch")
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
    requests = os.dup(0)
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
    pending = b""
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
            chunk = os.read(requests, 65536)
            if not chunk:  # the supervisor is done with it
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    answer({"id": request["id"], "error": str(exc)})
                    continue
                if pid == 0:
                    _run_child(request, server_pid, [requests, answers.fileno(), reaped, woken, selector.fileno()])
                answer({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    serve(sys.argv[1:])
