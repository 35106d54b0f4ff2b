"""The fork server with real processes: a child forked from it is the process
``python -m module`` would have been (its own session, environment, output and
torch threads), its exit and its kill are reported as a new process's would be, an
environment the server cannot give is refused, no child's environment is in the
memory later children are forked from, and the server's children die with it.
The supervisor's restarts of forked children: tests/integration/test_supervisor.py."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from services.ops import forkserver
from services.ops.forkserver import ForkServer
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHILD = "tests.integration.children.forked"


@pytest.fixture
def forks(tmp_path: Path) -> Iterator[ForkServer]:
    server = ForkServer(tmp_path / "forkserver.log", preload=("tests.integration.children", "torch"))
    try:
        yield server
    finally:
        server.close()


def child_env(tmp_path: Path, **darkroom: str) -> dict[str, str]:
    tmp_path.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    return {**os.environ, "PYTHONPATH": str(REPO), "DARKROOM_TEST_REPORT": str(report), **darkroom}


def report_of(tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "report.json"
    wait_for(path.exists, bool, timeout=60, what="its report")
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def test_a_forked_child_is_the_process_python_dash_m_would_have_been(tmp_path: Path, forks: ForkServer) -> None:
    env = child_env(tmp_path, DARKROOM_TEST_WORD="hello", DARKROOM_TEST_EXIT="3", OMP_NUM_THREADS="2")
    child = forks.fork(CHILD, env, tmp_path / "child.log")
    assert child.wait(60) == 3 and child.poll() == 3
    report = report_of(tmp_path)
    assert report["pid"] == child.pid and report["sid"] == child.pid  # a session of its own, as start_new_session
    assert report["ppid"] not in (os.getpid(), 1)  # the server's, not ours
    assert report["name"] == "__main__" and str(report["argv0"]).endswith("children/forked.py")
    assert report["word"] == "hello"
    # The server imported torch with one thread (this suite's); the child runs with its own.
    assert report["threads"] == 2
    assert f"forked child {child.pid} says hello" in (tmp_path / "child.log").read_text()
    # What it spent, its imports of torch in the first place, is counted while it runs (tests/reporting.py).
    assert forks.cpu_seconds() > 0.5


def test_a_forked_childs_signals_are_reported_as_a_new_processs(tmp_path: Path, forks: ForkServer) -> None:
    child = forks.fork(CHILD, child_env(tmp_path), tmp_path / "child.log")
    report_of(tmp_path)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    killed = forks.fork(CHILD, child_env(tmp_path), tmp_path / "child.log")
    report_of(tmp_path)
    os.killpg(killed.pid, signal.SIGKILL)  # as ManagedProcess.kill does
    assert killed.wait(30) == -signal.SIGKILL


def test_a_child_is_forked_only_where_its_imports_would_read_what_the_servers_read(
    tmp_path: Path, forks: ForkServer
) -> None:
    env = child_env(tmp_path, DARKROOM_TEST_EXIT="0")
    assert forks.fork(CHILD, env, tmp_path / "child.log").wait(60) == 0
    assert forks.compatible(
        {**env, "DARKROOM_WORKER_ID": "another", "OMP_NUM_THREADS": "7", "CUDA_VISIBLE_DEVICES": "1"}
    )
    # Read when torch is imported (the server's import, not the child's): a new process.
    assert not forks.compatible({**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert not forks.compatible({**env, "HOME": str(tmp_path)})  # Hugging Face's cache, found on import
    # Not read by an import (a test's name, pytest's): forked, with its own.
    assert forks.compatible({**env, "PYTEST_CURRENT_TEST": "another"})


def markers_in_memory(pid: int) -> set[str]:
    """The markers (``darkroom-marker-`` and 32 hex digits) in the writable memory
    (heaps, stacks, data) of process ``pid``, one of this process's descendants."""
    found: set[str] = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
        for line in maps:
            addresses, permissions = line.split()[:2]
            if not permissions.startswith("rw"):
                continue
            start, end = (int(a, 16) for a in addresses.split("-"))
            memory.seek(start)
            try:
                data = memory.read(end - start)
            except OSError:  # a mapping gone since the list was read
                continue
            found.update(m.decode() for m in re.findall(rb"darkroom-marker-[0-9a-f]{32}", data))
    return found


def test_no_childs_environment_is_in_the_memory_later_children_are_forked_from(tmp_path: Path) -> None:
    """As the gateway and the HTTP API forked one after the other: neither's settings
    (its store key) enter the server, whose memory each child forked next starts as a copy of."""
    forks = ForkServer(tmp_path / "forkserver.log", preload=("tests.integration.children", "json"))
    gateways, https = (f"darkroom-marker-{uuid.uuid4().hex}" for _ in range(2))
    try:
        gateway_env = child_env(tmp_path / "gateway", DARKROOM_MODEL_STORE_SECRET_KEY=gateways)
        forks.fork(CHILD, gateway_env, tmp_path / "gateway.log")
        report_of(tmp_path / "gateway")
        http = forks.fork(
            CHILD, child_env(tmp_path / "http", DARKROOM_MODEL_STORE_SECRET_KEY=https), tmp_path / "h.log"
        )
        server = report_of(tmp_path / "http")["ppid"]
        assert https in markers_in_memory(http.pid)  # found where it is: the child's own environment
        assert markers_in_memory(server).isdisjoint({gateways, https})
        server_environ = Path(f"/proc/{server}/environ").read_bytes().split(b"\0")
        assert [v for v in server_environ if v.startswith(b"DARKROOM_")] == []  # the server starts without settings
    finally:
        forks.close()


def test_the_servers_children_die_with_it(tmp_path: Path, forks: ForkServer) -> None:
    child = forks.fork(CHILD, child_env(tmp_path), tmp_path / "child.log")
    report_of(tmp_path)
    forks.close(timeout=10)
    assert child.wait(30) == -signal.SIGKILL
    wait_for(
        lambda: not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE,
        bool,
        timeout=10,
        what="the child gone",
    )


def test_the_supervisors_of_one_process_fork_from_one_server(tmp_path: Path) -> None:
    """A test worker's stacks, one after another: the second pays no imports again."""
    preload = ("tests.integration.children", "json")  # this test's own server
    first, second = forkserver.shared(tmp_path / "forkserver.log", preload), forkserver.shared(tmp_path, preload)
    assert first is second
    one = first.fork(CHILD, child_env(tmp_path / "one"), tmp_path / "one.log")
    server = report_of(tmp_path / "one")["ppid"]
    one.terminate()
    assert one.wait(30) == -signal.SIGTERM
    two = second.fork(CHILD, child_env(tmp_path / "two"), tmp_path / "two.log")
    assert report_of(tmp_path / "two")["ppid"] == server
    two.terminate()
    assert two.wait(30) == -signal.SIGTERM


def test_a_process_that_exits_reaps_its_servers_and_their_cpu_is_counted(tmp_path: Path) -> None:
    """As a new process's would be: the suite's CPU per test (tests/reporting.py)
    counts a bench script's or ``darkroom up``'s stacks once that process exits."""
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from services.ops import forkserver\n"
        "server = forkserver.shared(Path(sys.argv[1]) / 'forkserver.log', ('tests.integration.children', 'torch'))\n"
        f"child = server.fork({CHILD!r}, {{**os.environ, 'DARKROOM_TEST_EXIT': '0'}}, Path(sys.argv[1]) / 'c.log')\n"
        "assert child.wait(60) == 0\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The script alone spends about 0.1 s (it imports no torch); its server's import of torch,
    # 1 to 2 s, is counted with it.
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime > 0.5


def test_a_server_killed_takes_its_children_and_the_next_fork_starts_another(tmp_path: Path, forks: ForkServer) -> None:
    child = forks.fork(CHILD, child_env(tmp_path), tmp_path / "child.log")
    server = report_of(tmp_path)["ppid"]
    os.kill(server, signal.SIGKILL)  # the OOM killer
    assert child.wait(30) == -signal.SIGKILL
    again = forks.fork(CHILD, child_env(tmp_path, DARKROOM_TEST_EXIT="0"), tmp_path / "child.log")
    assert again.wait(60) == 0
    assert report_of(tmp_path)["ppid"] not in (server, os.getpid())
