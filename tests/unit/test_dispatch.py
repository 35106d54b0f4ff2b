from __future__ import annotations

import pytest

from services.bus.dispatch import Dispatch, dispatch_subject
from services.errors import MalformedDispatch
from services.generation import JobShape


def test_dispatch_round_trips() -> None:
    assert Dispatch.decode(Dispatch("j1", 3).encode()) == Dispatch("j1", 3)
    full = Dispatch("j1", 3, 1795000000.25, "pass-1", 4, JobShape("sd15", 512, 768, 20, 7.5, 2))
    assert Dispatch.decode(full.encode()) == full


def test_a_dispatch_from_before_shapes_runs_alone() -> None:
    # What an older scheduler published: no shape, no pass.
    assert Dispatch.decode(b'{"job_id": "j1", "attempt": 2}') == Dispatch("j1", 2)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'{"job_id": "j1"}',
        b'{"job_id": 5, "attempt": 1}',
        b'{"job_id": "j1", "attempt": 0}',
        b'{"job_id": "j1", "attempt": 1, "published_at": -1}',
        b'{"job_id": "j1", "attempt": 1, "pass_jobs": -2}',
        b'{"job_id": "j1", "attempt": 1, "shape": {"model": "sd15"}}',
    ],
)
def test_malformed_dispatch_is_named(data: bytes) -> None:
    with pytest.raises(MalformedDispatch, match="malformed dispatch"):
        Dispatch.decode(data)


def test_worker_ids_must_be_subject_tokens() -> None:
    assert dispatch_subject("host-gpu0") == "darkroom.dispatch.host-gpu0"
    with pytest.raises(ValueError, match="worker id"):
        dispatch_subject("a.b")
