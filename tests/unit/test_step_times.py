"""How a step's time grows with the batch (scheduler.estimates' ``step_seconds``):
learned from the run times of jobs of any steps, linear between learned batch
sizes, bounded outside them, the registry's first estimate before anything is
learned."""

from __future__ import annotations

import pytest

from scheduler import estimates
from scheduler.estimates import Durations, Learned, Shape, along_batch

STEP_S = 0.05  # registry: one step of one 512x512 image, seconds
PIXELS = 512 * 512


def observed(durations: Durations, runs: list[tuple[int, int, float]]) -> Durations:
    """After jobs of "sd" at 512x512 ran (steps, batch rows, seconds) on worker "w"."""
    shapes = [(Shape("sd", PIXELS, steps, rows), "w", seconds) for steps, rows, seconds in runs]
    return estimates.learn(durations, shapes, {"sd": STEP_S})


def test_nothing_learned_is_the_registrys_estimate_linear_in_the_batch() -> None:
    assert Durations().step_seconds("sd", PIXELS, 1, STEP_S) == pytest.approx(0.05)
    assert Durations().step_seconds("sd", PIXELS, 4, STEP_S) == pytest.approx(0.2)
    assert Durations().step_seconds("sd", 2 * PIXELS, 4, STEP_S) == pytest.approx(0.4)


def test_a_step_at_a_batch_between_two_learned_ones_lies_between_them_and_follows_learning() -> None:
    # A step of 1 image takes 0.05 s and a step of 8 takes 0.12 s.
    d = observed(Durations(), [(20, 1, 1.0), (30, 8, 3.6)])
    at_1, at_8 = d.step_seconds("sd", PIXELS, 1, STEP_S), d.step_seconds("sd", PIXELS, 8, STEP_S)
    assert (at_1, at_8) == pytest.approx((0.05, 0.12))
    at_4 = d.step_seconds("sd", PIXELS, 4, STEP_S)
    assert at_1 < at_4 < at_8
    assert at_4 == pytest.approx(0.05 + 0.07 * 3 / 7)
    # Batches of 8 turn out slower: the step at 4 follows.
    slower = observed(d, [(20, 8, 4.0)])
    assert slower.step_seconds("sd", PIXELS, 4, STEP_S) > at_4
    # A batch of 4 measured: it is what is learned, not the line.
    measured = observed(d, [(25, 4, 2.0)])
    assert measured.step_seconds("sd", PIXELS, 4, STEP_S) == pytest.approx(0.08)


def test_jobs_of_different_steps_at_one_batch_size_make_one_step_time() -> None:
    # Two shapes of batch 2: 0.06 s a step (seen 3 times) and 0.09 s (seen once).
    d = Durations(
        shapes={
            Shape("sd", PIXELS, 10, 2).key: Learned(0.6, 3),
            Shape("sd", PIXELS, 40, 2).key: Learned(3.6, 1),
        }
    )
    assert d.step_seconds("sd", PIXELS, 2, STEP_S) == pytest.approx((3 * 0.06 + 0.09) / 4)
    # Other models and sizes learn nothing from them.
    assert d.step_seconds("sd", 2 * PIXELS, 2, STEP_S) == pytest.approx(0.2)
    assert d.step_seconds("xl", PIXELS, 2, STEP_S) == pytest.approx(0.1)


def test_one_learned_batch_size_scales_in_proportion() -> None:
    d = observed(Durations(), [(20, 4, 1.6)])  # 0.08 s a step for 4 images
    assert d.step_seconds("sd", PIXELS, 8, STEP_S) == pytest.approx(0.16)
    assert d.step_seconds("sd", PIXELS, 2, STEP_S) == pytest.approx(0.04)


def test_outside_the_learned_sizes_the_nearest_line_holds_within_bounds() -> None:
    learned = [(2, 0.06), (4, 0.08)]  # 0.01 s more a step for each image
    assert along_batch(learned, 6) == pytest.approx(0.10)
    assert along_batch(learned, 1) == pytest.approx(0.05)
    # A line that would make a step cheaper with more images is held at the
    # nearest learned step; one that would make an image cheaper alone than in
    # the batch is held at that image's cost in it.
    assert along_batch([(2, 0.10), (4, 0.08)], 8) == pytest.approx(0.08)
    assert along_batch([(2, 0.02), (4, 0.08)], 1) == pytest.approx(0.01)
    assert along_batch([(2, 0.02), (4, 0.08)], 8) == pytest.approx(0.16)
