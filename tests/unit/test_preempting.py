"""Which jobs of a placement pass may make room by preemption, and where."""

from __future__ import annotations

from dataclasses import replace

from scheduler import policy
from scheduler.driver import PassDecision, waiting_for_room
from services.config.placement import PreemptionSettings

CONFIG = PreemptionSettings(preemptible=frozenset({"free"}), preempting_lanes=frozenset({"paid"}), for_targets=False)


def decision(placements: list[policy.Placement], lanes: dict[str, str]) -> PassDecision:
    jobs = {j: policy.JobView(j, "m", 512, 512, 20, 1, priority=10) for j in lanes}
    return PassDecision(placements, jobs, lanes, [], policy.Fleet({}), now=0.0)


def placement(job_id: str, worker_id: str | None) -> policy.Placement:
    candidates = tuple(policy.Candidate(w, True, 5.0, "warm") for w in ("w1", "w2"))
    return policy.Placement(job_id, worker_id, "test", candidates)


def test_only_preempting_lanes_wait_for_room_in_the_pass_order() -> None:
    view = decision(
        [placement("p2", None), placement("f1", None), placement("p1", None)],
        {"p1": "paid", "p2": "paid", "f1": "free"},
    )
    assert [(job.id, lane) for job, lane, _ in waiting_for_room(view, CONFIG)] == [("p2", "paid"), ("p1", "paid")]
    assert waiting_for_room(view, replace(CONFIG, preemptible=frozenset())) == []


def test_a_job_placed_behind_work_can_only_be_helped_where_it_was_placed() -> None:
    view = decision([placement("p1", "w2"), placement("p2", None)], {"p1": "paid", "p2": "paid"})
    [(_, _, placed), (_, _, queued)] = waiting_for_room(view, CONFIG)
    assert [c.worker_id for c in placed.candidates] == ["w2"]
    assert [c.worker_id for c in queued.candidates] == ["w1", "w2"]
