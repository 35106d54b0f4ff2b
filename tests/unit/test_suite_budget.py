"""The suite guards its own time: ``.ci/within`` fails a command that runs past its
budget (scaled by how much slower than the reference the machine ran), naming it,
and every run prints the time per directory (tests/reporting.py) whether its tests
ran in one process or across pytest-xdist's workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reporting import directory_of

REPO = Path(__file__).resolve().parents[2]


def within(budget_s: int, *command: str, reference_s: float = 1000.0) -> subprocess.CompletedProcess[str]:
    """``.ci/within`` with short speed readings against ``reference_s`` (by default
    a reference no machine is slower than: the budget as given)."""
    env = {**os.environ, "CI_SPEED_SECONDS": "0.2", "CI_SPEED_REFERENCE_S": str(reference_s)}
    return subprocess.run(
        [str(REPO / ".ci" / "within"), str(budget_s), "the work", *command],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_a_command_past_its_budget_fails_naming_it() -> None:
    done = within(1, "sleep", "2.2")
    assert done.returncode == 1
    assert done.stderr.startswith("FAILED: the work took "), done.stderr
    assert " s, over its budget of 1 s" in done.stderr


def test_a_command_within_its_budget_passes_and_says_its_time() -> None:
    done = within(30, "true")
    assert done.returncode == 0, done.stderr
    assert "the work took 0 s of its budget of 30 s" in done.stdout


def test_the_budget_is_scaled_by_how_much_slower_the_machine_ran_at_most_three_times() -> None:
    # Against a reference a thousand times quicker than any machine: 3x, no more.
    # (`date +%s`: whole seconds, so a sleep of 3.2 s takes 3 or 4.)
    done = within(2, "sleep", "3.2", reference_s=0.0001)
    assert done.returncode == 0, done.stderr
    assert "of its budget of 2 s x 3.00 = 6 s; this machine ran 3.00x the reference's time" in done.stdout
    past = within(1, "sleep", "4.2", reference_s=0.0001)
    assert past.returncode == 1 and "over its budget of 1 s x 3.00 = 3 s" in past.stderr, past.stderr


def test_a_failing_command_passes_its_own_status_on() -> None:
    assert within(30, "sh", "-c", "exit 3").returncode == 3


@pytest.mark.parametrize(
    ("nodeid", "directory"),
    [
        ("tests/unit/test_x.py::test_y", "tests/unit"),
        ("tests/integration/children/test_x.py::test_y[a/b]", "tests/integration"),
        ("tests/test_top.py::test_y", "tests"),
    ],
)
def test_a_tests_time_counts_under_its_directory(nodeid: str, directory: str) -> None:
    assert directory_of(nodeid) == directory


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_every_run_ends_with_the_time_per_directory_and_the_scenarios(tmp_path: Path, workers: list[str]) -> None:
    """A scenario summed up in a worker reaches the controller's table."""
    suite = tmp_path / "suite" / "unit"
    suite.mkdir(parents=True)
    (tmp_path / "suite" / "conftest.py").write_text('pytest_plugins = ["tests.reporting"]\n')
    (suite / "test_a.py").write_text(
        "from tests.faults.harness import SUMMARIES, Summary\n"
        "def test_one():\n"
        "    s = Summary('a broken thing', 3, 3, {}, 0, 0, 1.5)\n"
        "    SUMMARIES.append(s)\n"
        "    s.notes.append('noticed after')\n"
        "def test_two():\n"
        "    pass\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            *workers,
            str(suite),
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "time per directory" in done.stdout
    [row] = [line.split() for line in done.stdout.splitlines() if line.endswith("  suite/unit")]
    assert row[2:] == ["2", "suite/unit"] and float(row[1]) > 0, row  # tests, and the CPU they spent
    tests = done.stdout.split("the 30 tests that spent the most CPU")[1].splitlines()
    assert {line.split()[-1] for line in tests if "::" in line} == {
        "suite/unit/test_a.py::test_one",
        "suite/unit/test_a.py::test_two",
    }
    assert "| a broken thing | 3 | 3 | 0 | 0 | 0 | 1.5 s |" in done.stdout
    assert "- a broken thing: noticed after" in done.stdout
