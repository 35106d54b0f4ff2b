"""A model's batch-size curve as measured: images per second at some batch sizes
(``/work/shared/gpu/h200-2026-11-26.md`` gives SD 1.5's on an H200 at 1, 2, 4 and
8), turned into what the simulator times batches by: the time of a batch of k
images as a multiple of one image's."""

from __future__ import annotations

import itertools


def check_curve(images: tuple[int, ...], images_per_s: tuple[float, ...]) -> None:
    """Raises ValueError unless the curve is one rate per batch size, the sizes
    rising from 1 (the time of one image is what the factors are multiples of) and
    every rate positive."""
    if len(images) != len(images_per_s):
        raise ValueError(f"curve_images has {len(images)} sizes but curve_images_per_s {len(images_per_s)} rates")
    if not images or images[0] != 1 or any(b <= a for a, b in itertools.pairwise(images)):
        raise ValueError(f"curve_images must rise from 1, not {list(images)}")
    if any(rate <= 0 for rate in images_per_s):
        raise ValueError(f"curve_images_per_s must all be positive, not {list(images_per_s)}")


def batch_factor(images: tuple[int, ...], images_per_s: tuple[float, ...], k: int) -> float:
    """The time of a batch of ``k`` images over that of one image: at a measured
    size, its images over its rate, times the rate of one; between measured sizes,
    interpolated linearly (a step's time grows about linearly with the batch once
    the GPU is full, and the measured sizes bracket the rest); past the largest,
    on with the last segment's slope."""
    times = [n / rate * images_per_s[0] for n, rate in zip(images, images_per_s, strict=True)]
    if len(images) == 1:
        return times[0] * k  # one point: no gain from batching can be told
    upper = next((i for i, n in enumerate(images) if n >= k), len(images) - 1)
    upper = max(upper, 1)
    (n0, t0), (n1, t1) = (images[upper - 1], times[upper - 1]), (images[upper], times[upper])
    return t0 + (t1 - t0) * (k - n0) / (n1 - n0)
