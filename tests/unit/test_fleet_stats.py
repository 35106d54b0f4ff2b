"""What an admin's GetStats says of each worker: presence's view of it with what the
database counted of it, matched by kind and id."""

from __future__ import annotations

from gateway.usage import fleet_workers
from services.db.states import WorkerKind, WorkerStatus
from tests.records import worker_record


def test_a_decoder_heard_under_a_samplers_id_shows_none_of_the_samplers_jobs() -> None:
    sampler = worker_record("gpu-7", completed=0)
    forged = worker_record("gpu-7", kind=WorkerKind.DECODER, completed=0)
    counted = [worker_record("gpu-7", completed=41, errors=2, busy_seconds=80.0)]
    stats = fleet_workers([sampler, forged], counted, {"gpu-7": 3}, {"gpu-7": ["job-1"]})
    by_kind = {s.kind: s for s in stats}
    assert (by_kind["sampler"].completed, by_kind["sampler"].errors, by_kind["sampler"].processing) == (41, 2, 3)
    assert list(by_kind["sampler"].running_jobs) == ["job-1"]
    assert (by_kind["decoder"].completed, by_kind["decoder"].errors, by_kind["decoder"].processing) == (0, 0, 0)
    assert list(by_kind["decoder"].running_jobs) == []


def test_a_worker_gone_is_left_out() -> None:
    gone = worker_record("gpu-1", status=WorkerStatus.GONE)
    assert fleet_workers([gone, worker_record("gpu-2")], [], {}, {})[0].worker_id == "gpu-2"
    assert len(fleet_workers([gone], [], {}, {})) == 0
