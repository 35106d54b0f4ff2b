"""Structured logs: every line about a job names it and its attempt."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from services.telemetry import logs


@pytest.fixture
def captured(capsys: pytest.CaptureFixture[str]):
    def configure(fmt: str) -> logging.Logger:
        logs.configure("INFO", service="unit", fmt=fmt)
        return logging.getLogger("darkroom.unit")

    yield configure
    logging.getLogger().handlers.clear()


def lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


def test_a_line_logged_about_a_job_names_it_wherever_it_is_logged(captured, capsys) -> None:
    log = captured("json")

    async def deep_inside() -> None:
        log.info("stored")

    async def handle() -> None:
        with logs.about_job("j1", 2):
            await asyncio.create_task(deep_inside())  # a task started inside carries it too
        log.info("next")

    asyncio.run(handle())
    stored, after = lines(capsys)
    assert (stored["message"], stored["job_id"], stored["attempt"], stored["service"]) == ("stored", "j1", 2, "unit")
    assert "job_id" not in after


def test_lines_about_one_or_several_jobs_say_so_explicitly(captured, capsys) -> None:
    log = captured("json")
    with logs.about_job("outer"):
        log.warning("recovered", extra=logs.job_fields("j9", 1))  # what the line says wins
        log.warning("handed back", extra=logs.jobs_fields(["b", "a"]))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed", extra=logs.job_fields("j3"))
    recovered, handed, failed = lines(capsys)
    assert (recovered["job_id"], recovered["attempt"]) == ("j9", 1)
    assert handed["job_ids"] == ["a", "b"]
    assert failed["job_id"] == "j3" and "attempt" not in failed and "RuntimeError: boom" in failed["exception"]


def test_text_lines_carry_the_same_fields(captured, capsys) -> None:
    log = captured("text")
    with logs.about_job("j1", 3):
        log.info("done")
    assert capsys.readouterr().err.rstrip().endswith("darkroom.unit: done job_id=j1 attempt=3")
