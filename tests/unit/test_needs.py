"""A suite that cannot run here is skipped on a developer's machine and fails in CI,
which is meant to run every suite; and CI prints why anything was skipped."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet.network import why_unavailable
from tests.needs import in_ci, verdict

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("env", "ci"),
    [({"CI": "true"}, True), ({"CI": "1"}, True), ({"CI": "TRUE "}, True), ({"CI": "false"}, False), ({}, False)],
)
def test_ci_is_ci_true(env: dict[str, str], ci: bool) -> None:
    assert in_ci(env) is ci


@pytest.mark.parametrize(
    ("euid", "missing", "netns_error", "ci", "expected"),
    [
        (0, [], "", True, ("run", "")),
        (0, [], "", False, ("run", "")),
        (1000, [], "", False, ("skip", "network namespaces need root (CI runs as root)")),
        (1000, [], "", True, ("fail", "network namespaces need root (CI runs as root)")),
        (0, ["tc", "iptables"], "", False, ("skip", "tc, iptables not installed")),
        (0, ["tc"], "", True, ("fail", "tc not installed")),
        (0, [], "Operation not permitted", False, ("skip", "cannot make a network namespace: Operation not permitted")),
        (0, [], "Operation not permitted", True, ("fail", "cannot make a network namespace: Operation not permitted")),
    ],
)
def test_the_fleet_suite_skips_where_it_cannot_run_and_fails_in_ci(
    euid: int, missing: list[str], netns_error: str, ci: bool, expected: tuple[str, str]
) -> None:
    what, reason = verdict(why_unavailable(euid, missing, netns_error), {"CI": "true"} if ci else {})
    assert (what, reason[: len(expected[1])]) == expected
    if what == "fail":
        assert "CI (CI=true) is meant to run this suite" in reason


def run_pytest(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_needing.py").write_text(
        "from tests.needs import require\n\n"
        "def test_needing_a_frobnicator() -> None:\n"
        '    require("no frobnicator on PATH")\n\n'
        "def test_needing_nothing() -> None:\n"
        '    require("")\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(REPO)}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path / "test_needing.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_test_that_cannot_run_is_skipped_with_its_reason_outside_ci(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout
    assert "SKIPPED [1]" in done.stdout and "no frobnicator on PATH" in done.stdout  # -rs: the reason


def test_a_test_that_cannot_run_fails_in_ci(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, "true")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout
    assert "no frobnicator on PATH; CI (CI=true) is meant to run this suite" in done.stdout


def test_ci_prints_the_reason_of_every_skip() -> None:
    """.ci/run's last command, the test run, asks pytest for the skips' reasons."""
    last = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    args = shlex.split(last)
    assert args[:3] == [".ci/within", "1800", "the tests"], last  # under its budget
    args = args[3:]
    assert args[1:3] == ["-m", "pytest"], last
    assert any(a.startswith("-r") and "s" in a[2:] for a in args), last
