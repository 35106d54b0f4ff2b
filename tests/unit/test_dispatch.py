from __future__ import annotations

import pytest

from services.bus import Dispatch, dispatch_subject
from services.errors import MalformedDispatch


def test_dispatch_round_trips() -> None:
    assert Dispatch.decode(Dispatch("j1", 3).encode()) == Dispatch("j1", 3)


@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b"[]", b'{"job_id": "j1"}', b'{"job_id": 5, "attempt": 1}', b'{"job_id": "j1", "attempt": 0}'],
)
def test_malformed_dispatch_is_named(data: bytes) -> None:
    with pytest.raises(MalformedDispatch, match="malformed dispatch"):
        Dispatch.decode(data)


def test_worker_ids_must_be_subject_tokens() -> None:
    assert dispatch_subject("host-gpu0") == "darkroom.dispatch.host-gpu0"
    with pytest.raises(ValueError, match="worker id"):
        dispatch_subject("a.b")
