"""Which jobs of a placement pass may make room by preemption, and where."""

from __future__ import annotations

from dataclasses import replace

from scheduler import policy
from scheduler.suspend_requests import PassView, waiting_for_room
from services.config.placement import PreemptionSettings
from services.db.records import JobSummary
from tests.records import summary

CONFIG = PreemptionSettings(preemptible=frozenset({"free"}), preempting_lanes=frozenset({"paid"}))


def in_queue(job_id: str, lane: str) -> JobSummary:
    return summary(id=job_id, lane=lane, priority=10, steps=20)


def placement(job_id: str, worker_id: str | None) -> policy.Placement:
    candidates = tuple(policy.Candidate(w, True, 5.0, "warm") for w in ("w1", "w2"))
    return policy.Placement(job_id, worker_id, "test", candidates)


def test_only_preempting_lanes_wait_for_room_in_the_pass_order() -> None:
    view = PassView(
        [placement("p2", None), placement("f1", None), placement("p1", None)],
        {"p1": in_queue("p1", "paid"), "p2": in_queue("p2", "paid"), "f1": in_queue("f1", "free")},
        [],
    )
    assert [(job.id, lane) for job, lane, _ in waiting_for_room(view, CONFIG)] == [("p2", "paid"), ("p1", "paid")]
    assert waiting_for_room(view, replace(CONFIG, preemptible=frozenset())) == []


def test_a_job_placed_behind_work_can_only_be_helped_where_it_was_placed() -> None:
    view = PassView([placement("p1", "w2"), placement("p2", None)], {j: in_queue(j, "paid") for j in ("p1", "p2")}, [])
    [(_, _, placed), (_, _, queued)] = waiting_for_room(view, CONFIG)
    assert [c.worker_id for c in placed.candidates] == ["w2"]
    assert [c.worker_id for c in queued.candidates] == ["w1", "w2"]
