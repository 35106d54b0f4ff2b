"""Warm-set planning rules of scheduler.warm_planner, over plain data.

GPUs have 24 GB. The 4 GB models fit side by side; two 16 GB models do not.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from scheduler.forecast import Forecast, Submitted, forecast
from scheduler.policy import ModelCost
from scheduler.warm_planner import GpuView, WarmSet, plan_warm_sets
from services.db.states import WorkerStatus

GB = 1024**3
COSTS = {
    "sd": ModelCost("image", 0.05, 8.0, 4 * GB),
    "anime": ModelCost("image", 0.05, 8.0, 4 * GB),
    "pix": ModelCost("image", 0.05, 8.0, 4 * GB),
    "xl": ModelCost("image", 0.1, 12.0, 16 * GB),
    "xl2": ModelCost("image", 0.1, 12.0, 16 * GB),
    "xl3": ModelCost("image", 0.1, 12.0, 16 * GB),
    "vid": ModelCost("video", 0.5, 30.0, 16 * GB),
}


def gpu(gid: str, *, warm: tuple[str, ...] = (), **overrides: Any) -> GpuView:
    base = GpuView(gid, frozenset(COSTS), frozenset(warm), vram_total_bytes=24 * GB, speed=1.0)
    return replace(base, **overrides)


def gpus(n: int) -> list[GpuView]:
    return [gpu(f"g{i}") for i in range(n)]


def primaries(plans: dict[str, WarmSet]) -> Counter[str | None]:
    return Counter(ws.primary for ws in plans.values())


def test_demand_is_work_per_second_by_model() -> None:
    submitted = [
        Submitted("sd", 30.0, False, True),
        Submitted("sd", 30.0, True, True),
        Submitted("xl", 60.0, True, True),
    ]
    # Steady sd: 1.0/s; xl only in the newer half: its rate there (2.0/s) and half its rise.
    assert forecast(submitted, 60.0).latency_bound == {"sd": pytest.approx(1.0), "xl": pytest.approx(3.0)}
    assert forecast([], 60.0) == Forecast({}, {})


def test_each_demanded_model_gets_a_gpu() -> None:
    plans = plan_warm_sets({"xl": 5.0, "xl2": 0.1}, gpus(2), COSTS)
    assert primaries(plans) == Counter({"xl": 1, "xl2": 1})


def test_a_capped_model_which_cannot_be_a_secondary_still_gets_a_gpu() -> None:
    # sd and anime can share a GPU; vid (capped) lives only where it is primary.
    plans = plan_warm_sets({"sd": 1.0, "anime": 0.5, "vid": 0.1}, gpus(2), COSTS, caps={"video": 2})
    assert any("vid" in ws.models for ws in plans.values()), plans


def test_model_with_most_demand_gets_more_gpus() -> None:
    plans = plan_warm_sets({"xl": 3.0, "xl2": 1.0}, gpus(4), COSTS)
    assert primaries(plans) == Counter({"xl": 3, "xl2": 1})


def test_undemanded_models_get_nothing() -> None:
    # sd would fit beside xl, and "nope" has no cost entry.
    plans = plan_warm_sets({"xl": 1.0, "sd": 0.0, "nope": 5.0}, gpus(2), COSTS)
    assert all(ws.models == {"xl"} for ws in plans.values())


def test_starts_from_what_is_loaded() -> None:
    plans = plan_warm_sets({"xl": 1.0, "xl2": 1.0}, [gpu("g0", warm=("xl2",)), gpu("g1", warm=("xl",))], COSTS)
    assert (plans["g0"].primary, plans["g1"].primary) == ("xl2", "xl")


def test_plan_roughly_matching_demand_does_not_move_gpus() -> None:
    # xl runs at 1.1 on one GPU; taking a GPU from xl2 would leave xl2 at 1.0,
    # less than 15% better: not worth a load.
    current = [gpu("g0", primary="xl"), gpu("g1", primary="xl2"), gpu("g2", primary="xl2")]
    plans = plan_warm_sets({"xl": 1.1, "xl2": 1.0}, current, COSTS)
    assert [plans[g].primary for g in ("g0", "g1", "g2")] == ["xl", "xl2", "xl2"]
    # A clear imbalance does move one.
    plans = plan_warm_sets({"xl": 2.0, "xl2": 1.0}, current, COSTS)
    assert primaries(plans) == Counter({"xl": 2, "xl2": 1})


@pytest.mark.parametrize(
    "demand",
    [
        pytest.param({"xl": 1.0, "xl2": 1.0, "xl3": 3.0}, id="models-that-cannot-share"),
        pytest.param({"xl": 3.0, "xl2": 1.0}, id="two-models"),
        pytest.param({"sd": 1.0, "anime": 1.0, "pix": 3.0}, id="models-that-share"),
    ],
)
def test_feeding_the_plan_back_gives_the_same_plan(demand: dict[str, float]) -> None:
    first = plan_warm_sets(demand, gpus(3), COSTS)
    again = plan_warm_sets(demand, [replace(g, primary=first[g.id].primary) for g in gpus(3)], COSTS)
    assert {g: ws.primary for g, ws in again.items()} == {g: ws.primary for g, ws in first.items()}


def test_cap_limits_gpus_whose_primary_is_the_capability() -> None:
    demand = {"vid": 5.0, "xl": 1.0}
    assert primaries(plan_warm_sets(demand, gpus(3), COSTS))["vid"] == 2
    assert primaries(plan_warm_sets(demand, gpus(3), COSTS, caps={"video": 1}))["vid"] == 1


def test_over_the_cap_the_fastest_gpu_keeps_the_capped_model() -> None:
    # Only 10% faster: not enough for a later swap to undo keeping the slower one.
    current = [gpu("g0", primary="vid"), gpu("g1", primary="vid", speed=1.1), gpu("g2", primary="xl")]
    plans = plan_warm_sets({"vid": 1.0, "xl": 1.0}, current, COSTS, caps={"video": 1})
    assert plans["g1"].primary == "vid"
    assert primaries(plans)["vid"] == 1


def test_models_that_fit_beside_the_primary_are_added_as_secondaries() -> None:
    plans = plan_warm_sets({"sd": 1.0, "anime": 1.0}, gpus(1), COSTS)
    assert plans["g0"].models == {"sd", "anime"}
    # Two 16 GB models do not fit together.
    plans = plan_warm_sets({"xl": 1.0, "xl2": 1.0}, gpus(1), COSTS)
    assert len(plans["g0"].models) == 1


def test_capped_models_are_not_added_as_secondaries() -> None:
    # vid (16 GB) would fit beside sd (4 GB), but a cap counts only primaries.
    plans = plan_warm_sets({"sd": 1.0, "vid": 0.1}, gpus(2), COSTS, caps={"video": 2})
    for ws in plans.values():
        assert ("vid" in ws.models) == (ws.primary == "vid")
    uncapped = plan_warm_sets({"sd": 1.0, "vid": 0.1}, gpus(2), COSTS)
    assert all("vid" in ws.models for ws in uncapped.values())


@pytest.mark.parametrize("state", [WorkerStatus.DRAINING, WorkerStatus.UNHEALTHY])
def test_gpus_not_ready_get_nothing(state: WorkerStatus) -> None:
    plans = plan_warm_sets({"xl": 1.0, "xl2": 1.0}, [gpu("off", state=state), gpu("on")], COSTS)
    assert set(plans) == {"on"}
