"""What every run of the suite prints at its end, whether its tests ran in one
process or across pytest-xdist's workers: the time and the CPU spent per directory
(next to ``--durations``' slowest tests, so that a regression shows in the log that
lands) and the fault and fleet scenarios' table, as docs/reliability.md and
docs/fleet.md show it.

The CPU is the test process's own and its children's once they are reaped (a
module's stack is counted at the module's end): on a machine of few cores the
suite is bound by CPU, and wall times under workers say little of who spent it.

Both travel in each test's report (``user_properties`` and ``duration``), the one
channel a worker's results reach the controlling process by."""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Generator
from pathlib import PurePosixPath
from typing import Any, cast

import pytest

from services.ops.forkserver import shared_cpu_seconds

FAULT_TABLE_HEADER = (
    "| scenario | jobs | succeeded | failed (reason) | lost | duplicated | time to recover |\n"
    "|---|---|---|---|---|---|---|"
)
_SCENARIO = "darkroom_scenario"  # a user property: (table row, notes)
_CPU = "darkroom_cpu_s"  # a report's: the CPU spent since the process's last report


def cpu_seconds() -> float:
    """This process's CPU and its reaped children's, user and system, and its fork
    servers' (services/ops/forkserver.py: the stacks' services are their children,
    reaped by them)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + shared_cpu_seconds()


def directory_of(nodeid: str) -> str:
    """The directory a test's time is counted under: ``tests/unit``, ``tests/integration``..."""
    parts = PurePosixPath(nodeid.split("::", 1)[0]).parts
    return "/".join(parts[:2]) if len(parts) > 2 else "/".join(parts[:-1]) or "."


class SuiteReport:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)
        self.cpu: dict[str, float] = defaultdict(float)
        self.module_cpu: dict[str, float] = defaultdict(float)
        self.test_cpu: dict[str, float] = defaultdict(float)
        self._cpu_at = cpu_seconds()
        self.scenarios: list[tuple[str, list[str]]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
        """In the process that ran the test: the scenarios it summed up, into its report."""
        if call.when == "call":
            from tests.faults.harness import SUMMARIES

            for summary in SUMMARIES:
                item.user_properties.append((_SCENARIO, (summary.row(), list(summary.notes))))
            SUMMARIES.clear()
        outcome = yield
        now = cpu_seconds()
        outcome.get_result().user_properties.append((_CPU, now - self._cpu_at))
        self._cpu_at = now

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """In the controlling process: every phase's time, and the scenarios."""
        directory = directory_of(report.nodeid)
        self.seconds[directory] += report.duration
        cpu = sum(cast(float, v) for name, v in report.user_properties if name == _CPU)
        self.cpu[directory] += cpu
        self.module_cpu[report.nodeid.split("::", 1)[0]] += cpu
        self.test_cpu[report.nodeid] += cpu
        if report.when == "call":
            self.tests[directory] += 1
            for name, value in report.user_properties:
                if name == _SCENARIO:
                    row, notes = cast("tuple[str, list[str]]", value)
                    self.scenarios.append((str(row), [str(n) for n in notes]))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.seconds:
            terminalreporter.section("time per directory (setup, call and teardown; summed over workers)")
            terminalreporter.write_line("   wall s    CPU s  tests  directory")
            for directory, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
                line = f"{seconds:9.1f} {self.cpu[directory]:8.1f} {self.tests[directory]:6d}  {directory}"
                terminalreporter.write_line(line)
            total, cpu, tests = sum(self.seconds.values()), sum(self.cpu.values()), sum(self.tests.values())
            terminalreporter.write_line(f"{total:9.1f} {cpu:8.1f} {tests:6d}  all")
            terminalreporter.section("the 20 modules that spent the most CPU")
            for module, seconds in sorted(self.module_cpu.items(), key=lambda kv: -kv[1])[:20]:
                terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
            # A module's fixtures count in the first test that asked for them.
            terminalreporter.section("the 30 tests that spent the most CPU (with the fixtures they set up)")
            for test, seconds in sorted(self.test_cpu.items(), key=lambda kv: -kv[1])[:30]:
                terminalreporter.write_line(f"{seconds:8.1f} s  {test}")
        if self.scenarios:
            terminalreporter.section("fault injection")
            terminalreporter.write_line(FAULT_TABLE_HEADER)
            for row, _ in self.scenarios:
                terminalreporter.write_line(row)
            for row, notes in self.scenarios:
                scenario = row.split(" | ")[0].removeprefix("| ")
                for note in notes:
                    terminalreporter.write_line(f"- {scenario}: {note}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteReport(), "darkroom-suite-report")
