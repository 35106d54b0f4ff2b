"""A job's stages from its timestamps: what GetJob, the metrics and the benchmark
all report."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from gateway.convert import stage_durations
from services.db.states import JobStatus
from services.telemetry.stages import STAGES, durations
from tests.records import record

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(*ms: float | None) -> list[datetime | None]:
    return [None if m is None else T0 + timedelta(milliseconds=m) for m in ms]


def test_each_stage_is_the_time_between_its_ends() -> None:
    got = durations(at(0, 3, 5, 6, 16, 20, 21))
    assert list(got) == [*STAGES, "total"]
    assert {k: round(v * 1000, 6) for k, v in got.items()} == {
        "queue": 3,
        "schedule": 2,
        "dispatch": 1,
        "sample": 10,
        "decode": 4,
        "store": 1,
        "total": 21,
    }


def test_a_stage_not_reached_is_left_out_and_clocks_that_disagree_make_no_negative_stage() -> None:
    got = durations(at(0, 3, None, 6, None, None, None))
    assert set(got) == {"queue"}
    assert durations(at(0, 5, 4, 6, 7, 8, 9))["schedule"] == 0.0  # the worker's clock was behind


def test_getjob_shows_no_store_stage_for_a_job_that_ended_without_a_result() -> None:
    seconds = [T0 + timedelta(seconds=s) for s in range(5)]
    job = record(
        created_at=seconds[0],
        scheduled_at=seconds[1],
        dispatched_at=seconds[2],
        started_at=seconds[3],
        finished_at=seconds[4],
        status=JobStatus.CANCELLED,
    )
    assert set(stage_durations(job)) == {"queue", "schedule", "dispatch"}
    stored = replace(job, status=JobStatus.SUCCEEDED, decoding_at=seconds[3], decoded_at=seconds[4])
    assert stage_durations(stored)["total"] == 4.0
