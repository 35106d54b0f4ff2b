"""Records to API messages."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf import timestamp_pb2

from gateway.convert import timestamp
from gateway.fleet_messages import lanes_message
from services.db.counts import LaneCount
from services.db.states import JobStatus


@pytest.mark.parametrize(
    "when",
    [
        datetime(2026, 11, 22, 20, 1, 2, 345678, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 1, tzinfo=UTC),
        datetime(2030, 1, 1, 5, 0, 0, tzinfo=timezone(timedelta(hours=3))),
    ],
)
def test_a_timestamp_is_the_one_protobuf_makes_of_the_same_moment(when: datetime) -> None:
    expected = timestamp_pb2.Timestamp()
    expected.FromDatetime(when)
    assert timestamp(when) == expected
    assert timestamp(None) is None


def test_the_queue_by_lane_adds_each_lanes_held_states_and_its_oldest_wait() -> None:
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    counts = [
        LaneCount(JobStatus.QUEUED, "free", 3, now - timedelta(seconds=40)),
        LaneCount(JobStatus.RUNNING, "free", 1, now - timedelta(seconds=90)),
        LaneCount(JobStatus.SCHEDULED, "free", 2, now - timedelta(seconds=5)),
        LaneCount(JobStatus.RUNNING, "paid", 1, now - timedelta(seconds=2)),
    ]
    lanes = {q.lane: (q.queued, q.held, q.oldest_queued_seconds) for q in lanes_message(counts, now)}
    assert lanes == {"free": (3, 3, 40.0), "paid": (0, 1, 0.0)}
