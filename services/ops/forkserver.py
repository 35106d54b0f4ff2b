"""A host's fork servers: a process that imports the libraries a sampler and a
decoder import (torch, diffusers, transformers, onnxruntime: most of what each
spends starting, docs/benchmarks.md) once, and forks each of them from there;
another the gateway's, the scheduler's and the HTTP API's (gRPC, SQLAlchemy,
aiohttp...). A supervisor restarting a crashed sampler, and a test suite starting
stacks by the dozen, then pay for a fork instead of the imports.

This is the supervisor's side, ``ForkServer``: it starts the server
(services/ops/forkserver_process.py) on its first request, asks it for children
over a unix socket (its stdin) and reads their pids and exits from its stdout
(``ForkedProcess``: what the supervisor uses of ``subprocess.Popen``).

A child's environment is its own (``os.environ`` is replaced in the child), and
the server never holds it: a request names the module and the log, and carries a
memory file (``memfd_create``) holding the environment, passed as a descriptor
(``SCM_RIGHTS``) that the server hands to the forked child and closes unread. The
child reads it after the fork, so no child's settings (a gateway's keys, its model
store identity) are in the memory that later children are forked from. The server
itself starts without the ``DARKROOM_*`` settings.

What a child's libraries read when they were imported is the server's: a child whose
environment differs from the server's in a variable a library may read on import
(``READ_ON_IMPORT``: torch's, CUDA's, Python's, Hugging Face's...) is started as
a new process instead (``compatible``). Those each child has of its own
(``PER_CHILD``) are set after the fork.

One server of each kind (``PRELOAD_OF``) serves a whole process (``shared``): the
supervisor of ``darkroom up`` or ``darkroom supervise``, and a test worker's
stacks, one after another.

Hosts with a GPU do not use it (``children.fork_servers``): whether importing
torch and diffusers touches the CUDA driver, which a forked child cannot use
again, is not measured on a GPU yet."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path

from services.config.fields import ENV_PREFIX
from services.ops.forked_child import ForkedProcess, proc_stat, wait_gone
from services.ops.processes import dying_with_parent, spawn

# What a server imports before it forks (``module:attribute,...``: diffusers' and
# transformers' lazy modules import theirs when an attribute is asked for): the
# libraries the services import, never the services' own modules, whose imports
# register their metrics (a forked gateway would serve a sampler's). A library not
# installed is left to the child.
CONTROL_PRELOAD = (
    *("grpc", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "grpc_status.rpc_status"),
    *("google.protobuf.message", "sqlalchemy.ext.asyncio", "sqlalchemy.dialects.postgresql.psycopg", "psycopg"),
    *("aiohttp", "nats", "cryptography.x509", "prometheus_client", "opentelemetry.sdk.trace"),
    *("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "uvloop", "psutil", "numpy", "PIL.Image"),
)
MODEL_PRELOAD = (
    *CONTROL_PRELOAD,
    *("torch", "safetensors.torch", "av", "onnxruntime", "obstore"),
    "diffusers:AutoencoderKL,UNet2DConditionModel,FlowMatchEulerDiscreteScheduler",
    "transformers:CLIPTextModel,CLIPTokenizer",
)
# Which server forks each service: samplers and decoders from the one that imported
# torch and diffusers, the others from one that did not (a gateway holding torch's
# pages would show their size as its own).
PRELOAD_OF = {
    "sampler": MODEL_PRELOAD,
    "decoder": MODEL_PRELOAD,
    "gateway": CONTROL_PRELOAD,
    "scheduler": CONTROL_PRELOAD,
    "http": CONTROL_PRELOAD,
}
# The variables a library may read when it is imported, by prefix: children that
# differ from the server in one of them are not forked from it.
READ_ON_IMPORT = (
    *("PYTHON", "LD_", "MALLOC", "HOME", "XDG_", "TMP", "TEMP"),
    *("TORCH", "PYTORCH", "CUDA", "NVIDIA", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS"),
    *("HF_", "HUGGINGFACE", "TRANSFORMERS", "DIFFUSERS", "TOKENIZERS", "ORT_", "GRPC_"),
)
# Of those, what a child has of its own: CUDA starts after the fork, and a child sets
# torch's thread count from OMP_NUM_THREADS itself (``_run_child``).
PER_CHILD = frozenset({"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED"})
START_TIMEOUT_S = 180.0
# The server itself: what it runs in its process, and in each child until that runs its module.
SERVER_MODULE = "services.ops.forkserver_process"


def read_on_import(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` a forked child takes from the server's imports: its value must be the server's."""
    return {k: v for k, v in env.items() if k.startswith(READ_ON_IMPORT) and k not in PER_CHILD}


class _Running:
    """One server process and what it was asked: a server that died takes its own
    requests and children with it, never those of the one started after it."""

    def __init__(self, proc: subprocess.Popen[bytes], requests: socket.socket, env: dict[str, str]) -> None:
        self.proc = proc
        self.requests = requests
        self.env = env
        self.asked: dict[int, Future[ForkedProcess]] = {}
        self.children: dict[int, ForkedProcess] = {}

    def read(self) -> None:
        """The server's answers and its children's exits, until it is gone."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if "exited" in message:
                child = self.children.pop(message["exited"], None)
                if child is not None:
                    child._exit(message["code"])
                continue
            asked = self.asked.pop(message["id"])
            if "error" in message:
                asked.set_exception(RuntimeError(f"the fork server could not start it: {message['error']}"))
            else:
                child = ForkedProcess(message["pid"])
                self.children[child.pid] = child
                asked.set_result(child)
        # The server is gone, and its children with it (their parent-death signal).
        self.proc.wait()
        for asked in list(self.asked.values()):
            asked.set_exception(RuntimeError(f"the fork server exited with {self.proc.returncode}"))
        for child in list(self.children.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                wait_gone(child.pid, timeout=5.0)
            child._exit(-signal.SIGKILL)


class ForkServer:
    """The supervisor's side: a server started on the first request (with the
    environment of that request, less the ``DARKROOM_*`` settings) and again after
    it died."""

    def __init__(self, log_path: Path, *, preload: tuple[str, ...]) -> None:
        self.log_path = log_path
        self.preload = preload
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._next_id = 0

    def _alive(self) -> _Running | None:
        running = self._running
        return running if running is not None and running.proc.poll() is None else None

    def compatible(self, env: Mapping[str, str]) -> bool:
        """Whether a child of ``env`` can be forked from this server (or the server
        is yet to start): what its libraries read on import is the server's."""
        with self._lock:
            running = self._alive()
            return running is None or read_on_import(env) == read_on_import(running.env)

    def fork(self, module: str, env: Mapping[str, str], log_path: Path) -> ForkedProcess:
        """``python -m module`` with ``env``, its output appended to ``log_path``, forked."""
        with self._lock:
            running = self._alive() or self._start(env)
            self._next_id += 1
            asked: Future[ForkedProcess] = Future()
            running.asked[self._next_id] = asked
            request = json.dumps({"id": self._next_id, "module": module, "log": str(log_path)}).encode()
            try:
                with _environment_file(env) as given:
                    socket.send_fds(running.requests, [request], [given])
            except OSError as exc:  # it died just now: the next start starts another
                running.asked.pop(self._next_id, None)
                raise RuntimeError(f"the fork server exited: {exc}") from exc
        return asked.result(START_TIMEOUT_S)

    def _start(self, env: Mapping[str, str]) -> _Running:
        if self._running is not None:  # one that died: its socket goes with it
            self._running.requests.close()
        own = {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Messages, each a request with its environment's descriptor: a socket's, as a pipe carries no descriptor.
        requests, servers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(self.log_path, "ab") as out, servers:
            proc = spawn(
                dying_with_parent([sys.executable, "-m", SERVER_MODULE, *self.preload], signal.SIGKILL),
                env={**own, "PYTHONUNBUFFERED": "1"},
                stdin=servers,
                stdout=subprocess.PIPE,
                stderr=out,
                start_new_session=True,
            )
        self._running = _Running(proc, requests, own)
        threading.Thread(target=self._running.read, name="darkroom-forkserver", daemon=True).start()
        return self._running

    def cpu_seconds(self) -> float:
        """What the running server and the children it reaped spent (0 when none runs):
        this process's ``getrusage`` counts them only once the server itself is reaped."""
        running = self._running
        if running is None:
            return 0.0
        fields = proc_stat(running.proc.pid)
        if not fields:
            return 0.0
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name
        return sum(int(n) for n in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def close(self, timeout: float = 10.0) -> None:
        """Stops the server (its children, still running, die with it)."""
        with self._lock:
            running, self._running = self._running, None
        if running is None:
            return
        running.requests.close()
        try:
            running.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            running.proc.kill()
            running.proc.wait()


_SHARED: dict[tuple[str, ...], ForkServer] = {}
_SHARED_LOCK = threading.Lock()


def shared(log_path: Path, preload: tuple[str, ...]) -> ForkServer:
    """This process's fork server of ``preload``, for every supervisor in it: it
    lives as long as the process (its stdin closes when the process exits, and it is
    sent SIGKILL if the process dies), its log at ``log_path`` of the first to ask for it."""
    with _SHARED_LOCK:
        if not _SHARED:
            # Closed, and reaped, as the process exits: what they and their children
            # spent reaches this process's parent's getrusage, as a new process's would.
            atexit.register(close_shared)
        if preload not in _SHARED:
            _SHARED[preload] = ForkServer(log_path, preload=preload)
        return _SHARED[preload]


def close_shared() -> None:
    """Stops this process's fork servers (their children, still running, die with them)."""
    with _SHARED_LOCK:
        servers = list(_SHARED.values())
    for server in servers:
        server.close()


def shared_cpu_seconds() -> float:
    """What this process's shared fork servers spent so far, their reaped children's included."""
    with _SHARED_LOCK:
        servers = list(_SHARED.values())
    return sum(server.cpu_seconds() for server in servers)


@contextlib.contextmanager
def _environment_file(env: Mapping[str, str]) -> Iterator[int]:
    """A memory file holding ``env`` (JSON), read from its start by the child it is given to."""
    given = os.fdopen(os.memfd_create("darkroom-child-env", os.MFD_CLOEXEC), "w+b")
    with given:
        given.write(json.dumps(dict(env)).encode())
        given.flush()
        given.seek(0)
        yield given.fileno()
