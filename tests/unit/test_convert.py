"""Records to API messages."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf import timestamp_pb2

from gateway.convert import timestamp


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
