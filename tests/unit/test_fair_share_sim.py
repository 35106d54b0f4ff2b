"""Fair sharing in the simulator, through the production policy: a heavy tenant's
bursts do not starve light tenants, and sharing only reorders (the heavy tenant's
throughput and the GPUs' utilisation are those of the run without it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.simulator import scenario as scenarios
from scheduler.simulator import trace as traces
from scheduler.simulator.conditions import HEAVY
from scheduler.simulator.fairness import Run, fair_run
from scheduler.simulator.scenario import ScenarioError

FAIRNESS = scenarios.DEFAULT_SCENARIO.with_name("fairness_scenario.toml")


@pytest.fixture(scope="module")
def short() -> scenarios.Scenario:
    return replace(scenarios.load(FAIRNESS), duration_s=900.0)


def test_the_heavy_tenant_sends_twenty_times_each_light_ones_rate(short: scenarios.Scenario) -> None:
    jobs = traces.trace(replace(short, duration_s=3600.0), 0.85)
    heavy = sum(1 for j in jobs if j.tenant == HEAVY)
    light = {j.tenant for j in jobs} - {HEAVY}
    assert len(light) == 8
    assert 17 < heavy / ((len(jobs) - heavy) / len(light)) < 23
    alone = traces.without(jobs, HEAVY)
    assert [(j.arrival_s, j.tenant, j.type) for j in alone] == [
        (j.arrival_s, j.tenant, j.type) for j in jobs if j.tenant != HEAVY
    ]


def test_light_tenants_keep_their_latency_beside_a_heavy_one(short: scenarios.Scenario) -> None:
    fair, unfair, alone = (fair_run(short, 0.85, run) for run in (Run.FAIR, Run.UNFAIR, Run.ALONE))
    assert not (fair.overloaded or unfair.overloaded or alone.overloaded)
    assert fair.light_p99_s <= 1.25 * alone.light_p99_s
    assert unfair.light_p99_s > 3 * alone.light_p99_s  # what fair sharing saves them from
    assert fair.heavy_jobs_per_s == pytest.approx(unfair.heavy_jobs_per_s, rel=0.02)
    assert fair.utilisation == pytest.approx(unfair.utilisation, rel=0.02)


def test_a_bad_tenants_table_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(FAIRNESS.read_text().replace("light = 8", "light = -1"))
    with pytest.raises(ScenarioError, match="tenants"):
        scenarios.load(bad)
