from __future__ import annotations

import pytest

from tests.faults.harness import SUMMARIES

HEADER = (
    "| scenario | jobs | succeeded | failed (reason) | lost | duplicated | time to recover |\n"
    "|---|---|---|---|---|---|---|"
)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not SUMMARIES:
        return
    terminalreporter.section("fault injection")
    terminalreporter.write_line(HEADER)
    for summary in SUMMARIES:
        terminalreporter.write_line(summary.row())
    for summary in SUMMARIES:
        for note in summary.notes:
            terminalreporter.write_line(f"- {summary.scenario}: {note}")
