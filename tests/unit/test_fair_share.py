"""Fair shares within a lane, on plain data: who takes the lane's turns."""

from __future__ import annotations

import pytest

from scheduler.fair_share import charged, decayed, fair_turns
from scheduler.policy import JobView, order_queue
from scheduler.snapshot import TenantUsage
from services.config.placement import PlacementSettings

CONFIG = PlacementSettings()
HALF_LIFE = 600.0


def job(id: str, tenant: str, at: float, *, lane: str = "free", target_s: float | None = 30.0) -> JobView:
    return JobView(id, "m", 512, 512, 20, 1, queued_at=at, lane=lane, tenant=tenant, target_s=target_s)


def seconds(_: JobView) -> float:
    return 5.0


def turns(jobs: list[JobView], *usage: TenantUsage, now: float = 100.0) -> list[str]:
    fair = fair_turns(jobs, usage, seconds, now=now, half_life_s=HALF_LIFE)
    return [j.id for j in order_queue(fair, CONFIG, now=now)]


def test_a_heavy_backlog_interleaves_with_a_light_tenants_job() -> None:
    backlog = [job(f"h{i}", "heavy", float(i)) for i in range(5)]
    assert turns([*backlog, job("l0", "light", 50.0)]) == ["h0", "l0", "h1", "h2", "h3", "h4"]


def test_the_lane_keeps_its_turns() -> None:
    jobs = [job(f"h{i}", "heavy", float(i)) for i in range(3)] + [job("l0", "light", 50.0)]
    fair = fair_turns(jobs, (), seconds, now=100.0, half_life_s=HALF_LIFE)
    assert sorted(j.queued_at for j in fair) == [0.0, 1.0, 2.0, 50.0]
    assert {j.id: j.queued_at for j in fair}["l0"] == 1.0


def test_recent_use_goes_last_and_weight_counts_against_it() -> None:
    jobs = [job("a0", "a", 0.0), job("b0", "b", 1.0)]
    assert turns(jobs, TenantUsage("a", used_s=20.0, at=100.0)) == ["b0", "a0"]
    # Twice the weight: 20 used counts as 10, more than b's 5 and less than b's 15.
    heavier = TenantUsage("a", 2.0, 20.0, 100.0)
    assert turns(jobs, heavier, TenantUsage("b", used_s=5.0, at=100.0)) == ["b0", "a0"]
    assert turns(jobs, heavier, TenantUsage("b", used_s=15.0, at=100.0)) == ["a0", "b0"]


def test_use_is_forgotten_by_half_life() -> None:
    jobs = [job("a0", "a", 0.0), job("b0", "b", 1.0)]
    a, b = TenantUsage("a", used_s=40.0, at=0.0), TenantUsage("b", used_s=15.0, at=1200.0)
    assert turns(jobs, a, b, now=1200.0) == ["a0", "b0"]  # 40 two half-lives ago counts 10
    assert decayed(40.0, 1200.0, HALF_LIFE) == pytest.approx(10.0)
    after = charged(a, 5.0, now=1200.0, half_life_s=HALF_LIFE)
    assert (after.tenant, after.used_s, after.at) == ("a", pytest.approx(15.0), 1200.0)


def test_lanes_and_latency_classes_are_shared_apart() -> None:
    # The paid job keeps its own turn: tenants share a lane, not the queue.
    jobs = [job("h0", "heavy", 0.0), job("h1", "heavy", 1.0), job("p0", "light", 2.0, lane="paid", target_s=10.0)]
    fair = {j.id: j.queued_at for j in fair_turns(jobs, (), seconds, now=5.0, half_life_s=HALF_LIFE)}
    assert fair == {"h0": 0.0, "h1": 1.0, "p0": 2.0}
    video = job("v0", "light", 0.5, target_s=None)  # best effort in the free lane: a class of its own
    fair = {j.id: j.queued_at for j in fair_turns([*jobs, video], (), seconds, now=5.0, half_life_s=HALF_LIFE)}
    assert fair["v0"] == 0.5


def test_one_tenant_keeps_its_own_order() -> None:
    jobs = [job("h1", "heavy", 1.0), job("h0", "heavy", 0.0)]
    assert fair_turns(jobs, (TenantUsage("heavy", used_s=99.0),), seconds, now=5.0, half_life_s=HALF_LIFE) == jobs
