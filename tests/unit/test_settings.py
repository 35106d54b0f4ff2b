"""Settings by section: parsed from real types, range-checked in one place, a bad one
naming its variable (or its key in a scenario file); the environment and scenario
files read placement and preemption with the same defaults and the same errors;
and docs/settings.md says what the definitions say."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from services.config import docs
from services.config.fields import Section, SettingsError, naming_tables
from services.config.placement import Lane, PlacementSettings, PreemptionSettings, check_names
from services.config.sections import KernelSettings, SchedulerSettings, Settings
from services.config.workers import SamplerSettings


def test_each_type_is_parsed_from_its_variable() -> None:
    s = Settings.from_env(
        {
            "DARKROOM_GATEWAY_PORT": "7000",
            "DARKROOM_HEARTBEAT_INTERVAL_S": "0.5",
            "DARKROOM_API_KEYS": "a, b",
            "DARKROOM_DATA_DIR": "/tmp/x",
            "DARKROOM_LOCAL_DECODE_FALLBACK": "yes",
            "DARKROOM_BEST_EFFORT": "video,batch",
            "DARKROOM_LOG_LEVEL": "debug",
            "OTHER": "1",
        }
    )
    assert s.gateway.port == 7000 and s.kernel.heartbeat_interval_s == 0.5
    assert s.gateway.api_keys == ("a", "b") and s.kernel.data_dir == Path("/tmp/x")
    assert s.sampler.local_decode_fallback is True and s.kernel.log_level == "DEBUG"
    assert s.scheduler.placement.best_effort == {"video", "batch"} == s.gateway.placement.best_effort
    assert SamplerSettings.from_env({"DARKROOM_LOCAL_DECODE_FALLBACK": "off"}).local_decode_fallback is False


def test_settings_round_trip_through_their_variables() -> None:
    s = Settings.from_env(
        {
            "DARKROOM_GATEWAY_PORT": "1234",
            "DARKROOM_PRELOAD_MODELS": "tiny",
            "DARKROOM_LANES": "paid:10:120:8,free:0:300",
            "DARKROOM_CAPABILITY_CAPS": "video:3",
            "DARKROOM_PREEMPT_FOR_TARGETS": "true",
            "DARKROOM_TRACE_SAMPLE_RATIO": "0.25",
        }
    )
    assert Settings.from_env(s.to_env()) == s
    assert s.with_env({"DARKROOM_DEVICE": "cpu"}).sampler.device == "cpu"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DARKROOM_GATEWAY_PORT", "many"),
        ("DARKROOM_MAX_ATTEMPTS", "0"),
        ("DARKROOM_WORKER_STALE_AFTER_S", "-1"),
        ("DARKROOM_HANG_AFTER_S", "nan"),
        ("DARKROOM_LOCAL_DECODE_FALLBACK", "maybe"),
        ("DARKROOM_TRACE_SAMPLE_RATIO", "1.5"),
        ("DARKROOM_OTLP_ENDPOINT", "collector:4317"),
        ("DARKROOM_LOG_FORMAT", "xml"),
        ("DARKROOM_LOG_LEVEL", "LOUD"),
        ("DARKROOM_LANES", "paid:10:120:0"),
        ("DARKROOM_LANES", "paid:10:120:8:9"),
        ("DARKROOM_LANES", ""),
        ("DARKROOM_CAPABILITY_TARGETS", "upscale"),
        ("DARKROOM_CAPABILITY_CAPS", "video:many"),
        ("DARKROOM_PREEMPT_TARGET_SHARE", "0"),
    ],
)
def test_a_bad_value_names_its_variable(variable: str, value: str) -> None:
    with pytest.raises(SettingsError, match=variable):
        Settings.from_env({variable: value})


def test_lanes_targets_and_caps_become_objects() -> None:
    s = SchedulerSettings.from_env(
        {
            "DARKROOM_LANES": "paid:10:120:8,free:0:300,bulk:-5",
            "DARKROOM_CAPABILITY_TARGETS": "upscale:4",
            "DARKROOM_CAPABILITY_CAPS": "video:3",
        }
    ).placement
    assert s.lanes == (Lane("paid", 10, 120.0, 8.0), Lane("free", 0, 300.0), Lane("bulk", -5, math.inf))
    assert s.capability_targets == (("upscale", 4.0),) and s.capability_caps == (("video", 3),)
    assert s.default_lane.name == "bulk" and s.target_s("paid", "upscale") == 4.0


def test_a_scenario_table_reads_the_same_fields_with_the_same_defaults() -> None:
    table: dict[str, Any] = {
        "lanes": {"paid": {"priority": 10, "max_wait_s": 120, "target_s": 8}, "free": {"priority": 0}},
        "capability_targets": {"upscale": 4},
        "capability_caps": {"video": 3},
        "best_effort": ["video"],
    }
    from_toml = PlacementSettings.from_table(table, "darkroom")
    from_env = PlacementSettings.from_env(
        {
            "DARKROOM_LANES": "paid:10:120:8,free:0",
            "DARKROOM_CAPABILITY_TARGETS": "upscale:4",
            "DARKROOM_CAPABILITY_CAPS": "video:3",
            "DARKROOM_BEST_EFFORT": "video",
        }
    )
    assert from_toml == from_env
    assert PlacementSettings.from_table({}, "darkroom") == PlacementSettings.from_env({}) == PlacementSettings()
    assert PreemptionSettings.from_table({}, "darkroom.preemption") == PreemptionSettings()


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"backlog_limit": -1}, "darkroom.backlog_limit"),
        ({"backlog_limit": 1.5}, "darkroom.backlog_limit"),
        ({"lanes": {"paid": {"priority": 1, "target_s": 0}}}, "darkroom.lanes"),
        ({"lanes": {}}, "darkroom.lanes"),
        ({"latency_headroom": 0.5}, "darkroom.latency_headroom"),
        ({"backlog": 1}, "darkroom: unknown keys"),
    ],
)
def test_a_bad_scenario_value_names_its_key(table: dict[str, Any], key: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(key)):
        PlacementSettings.from_table(table, "darkroom")


def test_names_must_exist_in_both_sources() -> None:
    placement = PlacementSettings(best_effort=frozenset({"vidoe"}))
    with pytest.raises(SettingsError, match="DARKROOM_BEST_EFFORT names 'vidoe'"):
        check_names(placement, PreemptionSettings(), {"image", "video"})
    with naming_tables({PlacementSettings: "darkroom"}), pytest.raises(SettingsError, match=r"darkroom\.best_effort"):
        check_names(placement, PreemptionSettings(), {"image", "video"})
    check_names(placement, PreemptionSettings())  # capabilities unknown: not judged
    vip = PreemptionSettings(preemptible=frozenset({"video"}), preempting_lanes=frozenset({"vip"}))
    with pytest.raises(SettingsError, match="DARKROOM_PREEMPTING_LANES names 'vip'"):
        check_names(PlacementSettings(), vip)
    check_names(PlacementSettings(lanes=(Lane("vip", 20, 10.0), Lane("free", 0, 300.0))), vip)
    both = PreemptionSettings(preemptible=frozenset({"paid"}), preempting_lanes=frozenset({"paid"}))
    with pytest.raises(SettingsError, match="DARKROOM_PREEMPTIBLE names 'paid'"):
        check_names(PlacementSettings(), both)
    with pytest.raises(SettingsError, match="DARKROOM_PREEMPTIBLE names 'vidoe'"):
        check_names(PlacementSettings(), PreemptionSettings(preemptible=frozenset({"vidoe"})), {"image", "video"})
    # The shipped defaults hold on a fleet that serves no video yet.
    check_names(PlacementSettings(), PreemptionSettings(), {"image"})


def test_preemption_from_its_variables() -> None:
    s = SchedulerSettings.from_env(
        {"DARKROOM_PREEMPTIBLE": "video,free", "DARKROOM_PREEMPTING_LANES": "paid", "DARKROOM_MAX_PREEMPTIONS": "3"}
    ).preemption
    assert s == PreemptionSettings(frozenset({"video", "free"}), frozenset({"paid"}), 3, 2.0)
    assert s.enabled and not PreemptionSettings(for_targets=False).enabled
    # On by default: best-effort work yields to a job that would miss its target.
    assert PreemptionSettings().enabled and SchedulerSettings.from_env({}).preemption.for_targets
    assert not SchedulerSettings.from_env({"DARKROOM_PREEMPT_FOR_TARGETS": "0"}).preemption.for_targets


def test_a_field_of_no_known_type_is_refused_at_definition() -> None:
    from dataclasses import dataclass

    from services.config.fields import setting

    @dataclass(frozen=True)
    class Odd(Section):
        when: complex = setting(0j, "a complex number")

    with pytest.raises(TypeError, match="no codec"):
        Odd.settings()


def test_every_setting_is_documented_in_one_place() -> None:
    variables: list[str] = []

    def walk(section: type[Section]) -> None:
        for s in section.settings():
            if s.nested is not None:
                walk(s.nested)
            else:
                assert len(s.spec.doc) > 15, s.variable
                variables.append(s.variable)

    walk(Settings)
    page = docs.render()
    assert all(f"`{v}`" in page for v in variables)
    assert KernelSettings.setting("data_dir").variable == "DARKROOM_DATA_DIR"


def test_the_committed_reference_is_current() -> None:
    assert docs.PAGE.read_text() == docs.render(), "run python -m services.config.docs"


def test_the_default_scenario_measures_the_policy_a_stack_ships_with() -> None:
    """docs/benchmarks.md's default-scenario figures are what `darkroom up` gets
    untouched: the same lanes and targets, best effort, preemption and weights."""
    from scheduler.simulator import scenario

    simulated, shipped = scenario.load(), SchedulerSettings.from_env({})
    assert [(lane.name, lane.priority, lane.target_s) for lane in simulated.darkroom.lanes] == [
        (lane.name, lane.priority, lane.target_s) for lane in shipped.placement.lanes
    ]
    # The simulator has no dispatch latency (so no backlog keeps a GPU fed) and
    # refuses no submit (so no lane's max_wait_s); the rest is the same.
    same = replace(simulated.darkroom, lanes=shipped.placement.lanes, backlog_limit=shipped.placement.backlog_limit)
    assert same == shipped.placement
    assert simulated.preemption == shipped.preemption
