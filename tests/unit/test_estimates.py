"""Duration estimates of scheduler.estimates: registry defaults, then learned."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from scheduler import estimates
from scheduler.costs import costs_from
from scheduler.estimates import WARMUP, Durations, Learned, Shape, default_seconds
from services.models.registry import ModelRegistry
from services.models.spec import FAMILY_DEFAULTS, ModelFamily, ModelSpec

STEP_S = 0.05  # registry: one step of one 512x512 image, seconds
SHAPE = Shape("sd", 512 * 512, 20, 1)  # 1 s by default


def learn(durations: Durations, runs: Iterable[tuple[str, float]], shape: Shape = SHAPE) -> Durations:
    """Feeds (worker id, seconds taken) observations of ``shape`` in order."""
    return estimates.learn(durations, [(shape, w, seconds) for w, seconds in runs], {shape.model: STEP_S})


def test_default_is_linear_in_pixels_steps_and_batch() -> None:
    assert default_seconds(SHAPE, STEP_S) == pytest.approx(1.0)
    assert default_seconds(Shape("sd", 1024 * 1024, 20, 1), STEP_S) == pytest.approx(4.0)
    assert default_seconds(Shape("sd", 512 * 512, 40, 1), STEP_S) == pytest.approx(2.0)
    assert default_seconds(Shape("sd", 512 * 512, 20, 3), STEP_S) == pytest.approx(3.0)
    assert default_seconds(SHAPE, 2 * STEP_S) == pytest.approx(2.0)


def test_nothing_learned_uses_the_default_over_the_declared_speed() -> None:
    assert Durations().seconds(SHAPE, STEP_S, "w") == pytest.approx(1.0)
    assert Durations().seconds(SHAPE, STEP_S, "w", declared_speed=2.0) == pytest.approx(0.5)


def test_first_observation_replaces_the_default() -> None:
    d = learn(Durations(), [("w", 10.0)])
    assert d.shape_seconds(SHAPE, STEP_S) == pytest.approx(10.0)
    assert d.seconds(SHAPE, STEP_S, "w") == pytest.approx(10.0)
    assert d.shapes[SHAPE.key].count == 1


def test_learned_shape_does_not_leak_to_other_shapes() -> None:
    d = learn(Durations(), [("w", 10.0)])
    other = Shape("sd", 512 * 512, 40, 1)
    assert d.shape_seconds(other, STEP_S) == pytest.approx(2.0)


def test_plain_mean_during_warmup() -> None:
    d = learn(Durations(), [("w", 10.0), ("w", 20.0), ("w", 30.0)])
    assert d.shape_seconds(SHAPE, STEP_S) == pytest.approx(20.0)


def test_after_warmup_the_newest_observation_has_a_fixed_weight() -> None:
    learned = Learned(10.0, 100).updated(20.0)
    assert learned.mean == pytest.approx(12.0)  # ALPHA = 0.2, not 1/101
    assert learned.count == 101


def test_learned_duration_follows_a_change() -> None:
    # A GPU that slows from 10 s to 20 s per job: a plain mean would still be
    # near 18.6 s after 30 slow jobs; the exponential average is at 20 s.
    d = learn(Durations(), [("w", 10.0)] * WARMUP + [("w", 20.0)] * 30)
    assert d.shape_seconds(SHAPE, STEP_S) == pytest.approx(20.0, abs=0.1)


def test_worker_taking_twice_as_long_learns_half_the_speed() -> None:
    d = learn(Durations(), [("fast", 10.0), ("slow", 20.0)] * 40)
    assert d.speed("slow") / d.speed("fast") == pytest.approx(0.5, rel=0.01)
    # And the estimates reproduce what each worker takes.
    assert d.seconds(SHAPE, STEP_S, "fast") == pytest.approx(10.0, rel=0.01)
    assert d.seconds(SHAPE, STEP_S, "slow") == pytest.approx(20.0, rel=0.01)


def test_learned_speed_overrides_the_declared_one() -> None:
    d = Durations(speeds={"a": Learned(1.0, 10), "b": Learned(1.0, 10)})
    assert d.speed("a", declared=4.0) == pytest.approx(1.0)
    assert d.speed("new", declared=4.0) == pytest.approx(4.0)


def test_mean_learned_speed_is_normalized_to_one() -> None:
    d = Durations(speeds={"a": Learned(2.0, 10), "b": Learned(4.0, 10)})
    assert d.speed("a") == pytest.approx(2 / 3)
    assert d.speed("b") == pytest.approx(4 / 3)


def test_learning_does_not_drift_the_speed_scale() -> None:
    # Defaults far off (1 s predicted, 10-20 s taken): the raw speed entries after
    # the first jobs are 0.1, 0.5 and 1.0, but the speeds used stay centred on 1.
    d = learn(Durations(), [("a", 10.0), ("b", 20.0), ("c", 15.0)])
    speeds = [d.speed(w) for w in ("a", "b", "c")]
    assert sum(speeds) / len(speeds) == pytest.approx(1.0)


def test_runs_of_a_model_without_a_first_estimate_are_passed_over() -> None:
    other = Shape("gone", 512 * 512, 20, 1)
    d = estimates.learn(Durations(), [(other, "w", 3.0), (SHAPE, "w", 2.0)], {"sd": STEP_S})
    assert set(d.shapes) == {SHAPE.key}


@pytest.mark.parametrize("family", list(ModelFamily))
def test_a_model_of_each_family_gets_its_familys_first_estimates(family: ModelFamily) -> None:
    """A registry entry that gives no step time or load time is placed by its family's
    until durations are learned: a 1024 px Flux.1 image is not costed as SD 1.5's."""
    source = "builtin:sim" if family == ModelFamily.SIM else "/models/m"
    spec = ModelSpec("m", source, family)
    [cost] = costs_from(ModelRegistry({"m": spec})).values()
    step_ms, load_s, _ = FAMILY_DEFAULTS[family]
    assert (cost.step_s_512, cost.load_s) == (step_ms / 1000, load_s)
    assert Durations().seconds(Shape("m", 1024 * 1024, 28, 1), cost.step_s_512, "w") == pytest.approx(
        step_ms / 1000 * 28 * 4
    )


def test_the_transformer_families_cost_more_than_sd15_per_step() -> None:
    sd15 = FAMILY_DEFAULTS[ModelFamily.SD15][0]
    for family in (ModelFamily.SD3, ModelFamily.FLUX, ModelFamily.FLUX_KONTEXT):
        assert FAMILY_DEFAULTS[family][0] > sd15
