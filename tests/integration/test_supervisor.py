"""The supervisor with real child processes: restarts with backoff, kills what
hangs, tells each start its restart count, and leaves nothing behind; each as
new processes and as children of a fork server (services/ops/forkserver.py)."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import psutil
import pytest

from services.ops.forkserver import ForkServer
from services.ops.supervisor import Child, RestartPolicy, Supervisor
from tests.helpers import wait_for

pytestmark = pytest.mark.integration
FLAKY = "tests.integration.children.flaky"
POLICY = RestartPolicy(backoff_s=0.2, backoff_max_s=1.0, hang_after_s=1.5, kill_grace_s=0.5)


def flaky(tmp_path: Path, mode: str, exits: int = 0) -> Child:
    env = {
        **os.environ,
        "FLAKY_MODE": mode,
        "FLAKY_EXITS": str(exits),
        "FLAKY_COUNTER": str(tmp_path / "starts"),
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    # A sampler: a service a fork server starts, when its supervisor has one.
    return Child("flaky", FLAKY, env, tmp_path / "flaky.log", tmp_path / "flaky.alive", service="sampler")


@pytest.fixture(params=["spawned", "forked"])
def supervisor(request: pytest.FixtureRequest, tmp_path: Path) -> Supervisor:
    if request.param == "spawned":
        return Supervisor(POLICY)
    forks = ForkServer(tmp_path / "forkserver.log", preload=("tests.integration.children",))
    return Supervisor(POLICY, forks={"sampler": forks})


def starts(tmp_path: Path) -> int:
    path = tmp_path / "starts"
    return int(path.read_text()) if path.exists() else 0


def test_exiting_child_is_restarted_with_backoff_and_told_its_restart_count(
    tmp_path: Path, supervisor: Supervisor
) -> None:
    child = supervisor.add(flaky(tmp_path, "exit", exits=3))
    supervisor.start()
    try:
        wait_for(lambda: starts(tmp_path), lambda n: n == 4, timeout=30, what="three restarts")
        first = child.pid
        wait_for(lambda: child.running, bool, timeout=10, what="the fourth start to stay up")
        time.sleep(1.0)
        assert child.running and child.pid == first and child.restarts == 3
        assert child.last_exit == "it exited with code 7"
        told = [(tmp_path / f"starts.restarts{n}").read_text() for n in range(1, 5)]
        assert told == ["0", "1", "2", "3"]
        # Quick failures back off: 0.2 s, 0.4 s, 0.8 s before the three restarts.
        assert child.quick_failures == 3
    finally:
        supervisor.stop()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in child.pids)


def test_hung_child_is_killed_and_restarted(tmp_path: Path, supervisor: Supervisor) -> None:
    child = supervisor.add(flaky(tmp_path, "hang"))
    supervisor.start()
    try:
        first = wait_for(lambda: child.pid, lambda pid: pid is not None, timeout=10, what="the child to start")
        wait_for(lambda: starts(tmp_path), lambda n: n >= 2, timeout=30, what="the hung child to be replaced")
        assert child.last_exit == "it hung"
        # It ignored SIGTERM: SIGKILL after the grace ended it.
        assert first is not None and not (psutil.pid_exists(first) and psutil.Process(first).status() != "zombie")
    finally:
        supervisor.stop(timeout=0.5)  # it ignores SIGTERM
    assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie" for pid in child.pids)


def test_stopped_child_stays_stopped_until_started(tmp_path: Path, supervisor: Supervisor) -> None:
    child = supervisor.add(flaky(tmp_path, "exit"))
    supervisor.start()
    try:
        wait_for(lambda: starts(tmp_path), lambda n: n == 1, timeout=10, what="the child to start")
        child.stop()
        time.sleep(1.0)
        assert not child.running and starts(tmp_path) == 1
        child.start()
        wait_for(lambda: starts(tmp_path), lambda n: n == 2, timeout=10, what="the child to start again")
        assert child.restarts == 0, "a stop and a start are not a restart"
    finally:
        supervisor.stop()


def test_a_group_shares_its_fate_and_re_forms_on_a_fresh_port(tmp_path: Path) -> None:
    """A member killed (a crash): its group's other member is killed at once, not
    left in a collective, and both start again together, told a fresh rendezvous
    port and the next epoch. A child of no group is left alone."""
    supervisor = Supervisor(POLICY)
    group = {
        "DARKROOM_GROUP_MEMBERS": "cpu0,cpu1",
        "DARKROOM_GROUP_ADDRESS": "127.0.0.1:1",
        "DARKROOM_GROUP_EPOCH": "0",
    }
    members = []
    for rank in range(2):
        (tmp_path / f"m{rank}").mkdir()
        member = flaky(tmp_path / f"m{rank}", "exit")
        member.name, member.env = f"sampler-{rank}", {**member.env, **group, "DARKROOM_GROUP_RANK": str(rank)}
        members.append(supervisor.add(member))
    (tmp_path / "alone").mkdir()
    alone = flaky(tmp_path / "alone", "exit")
    alone.name = "sampler-2"
    supervisor.add(alone)
    supervisor.start()
    try:
        for rank in range(2):
            wait_for(functools.partial(starts, tmp_path / f"m{rank}"), lambda n: n == 1, timeout=10, what=f"{rank}")
        wait_for(lambda: starts(tmp_path / "alone"), lambda n: n == 1, timeout=10, what="the single sampler")
        survivor = members[1].pid
        members[0].kill()
        for rank in range(2):
            wait_for(
                functools.partial(starts, tmp_path / f"m{rank}"), lambda n: n == 2, timeout=10, what=f"{rank} again"
            )
        assert survivor is not None and not (
            psutil.pid_exists(survivor) and psutil.Process(survivor).status() != "zombie"
        )
        addresses = {m.env["DARKROOM_GROUP_ADDRESS"] for m in members}
        assert len(addresses) == 1 and addresses != {"127.0.0.1:1"}
        assert {m.env["DARKROOM_GROUP_EPOCH"] for m in members} == {"1"}
        assert members[1].last_exit == "its group broke"
        assert starts(tmp_path / "alone") == 1 and alone.restarts == 0
    finally:
        supervisor.stop()
