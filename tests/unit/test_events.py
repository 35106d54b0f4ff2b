"""Job events as they travel on NATS: encoded and decoded, one subject per job and
publisher."""

from __future__ import annotations

import pytest

from services.bus.events import JobEvent, job_subject, parse_subject
from services.db.states import JobStatus


@pytest.mark.parametrize(
    "event",
    [
        JobEvent("j1", 2, JobStatus.DECODING),
        JobEvent("j1", 2, JobStatus.SCHEDULED, worker="w1"),  # a placement names its worker
        JobEvent("j1", 1, step=3, total=20),
        JobEvent("j1", 0),  # a change to read from the database
    ],
)
def test_events_round_trip(event: JobEvent) -> None:
    assert JobEvent.decode("j1", event.encode()) == event


def test_progress_is_a_step_of_a_total() -> None:
    assert JobEvent("j1", 1, step=0, total=5).progress
    assert not JobEvent("j1", 1, JobStatus.RUNNING).progress
    assert not JobEvent("j1", 1).progress


@pytest.mark.parametrize("data", [b"", b"[]", b"{}", b'{"attempt": "x"}', b'{"attempt": 1, "status": "NAPPING"}'])
def test_anything_else_is_not_an_event(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a job event"):
        JobEvent.decode("j1", data)


def test_a_job_id_or_publisher_that_is_no_subject_token_is_refused() -> None:
    assert job_subject("0b7c3c1e-1a2b", "sampler-gpu0") == "darkroom.job.0b7c3c1e-1a2b.sampler-gpu0"
    for bad in ("a.b", "*", ">", "", "a b"):
        with pytest.raises(ValueError, match="subject token"):
            job_subject(bad, "gateway")
        with pytest.raises(ValueError, match="subject token"):
            job_subject("j1", bad)


def test_the_subject_names_the_job_and_its_publisher() -> None:
    assert parse_subject(job_subject("j1", "scheduler")) == ("j1", "scheduler")
    assert parse_subject("darkroom.job.j1") == ("j1", "")  # a publisher before they were named
    # The publisher comes from the subject, never from the message.
    assert JobEvent.decode("j1", JobEvent("j1", 1, step=1, total=2).encode(), "sampler-w1").publisher == "sampler-w1"
