"""How long a job takes: defaults per model, learned online from completed jobs.

A duration is learned per *shape* (model, pixels, steps, batch) in seconds on a
speed-1.0 worker, and each worker's speed is learned from how its jobs compare
with those shapes. The estimate of a job on a worker is the shape's duration over
the worker's speed. Both are running means that turn into exponential averages
after ``WARMUP`` observations, so they follow a GPU that slows down (heat, a
noisy neighbour) without forgetting everything at once.

A step's time at each batch size (``Durations.step_seconds``) comes from the same
shapes: what a job joining a running batch costs depends on how a step grows
with the batch, not on any one shape.

Pure: a frozen table in, a new entry out. The scheduler and the simulator read
the same table; workers record how long each job ran, and the scheduler folds
those run times in and stores the table, so estimates survive restarts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

REFERENCE_PIXELS = 512 * 512
WARMUP = 5  # plain mean over the first observations, then EWMA
ALPHA = 0.2  # weight of the newest observation once warm


@dataclass(frozen=True)
class Shape:
    model: str
    pixels: int
    steps: int
    batch: int

    @cached_property
    def key(self) -> str:
        return f"{self.model}|{self.pixels}|{self.steps}|{self.batch}"


@dataclass(frozen=True)
class Learned:
    mean: float
    count: int

    def updated(self, value: float) -> Learned:
        weight = max(1.0 / (self.count + 1), ALPHA)
        return Learned(self.mean + weight * (value - self.mean), self.count + 1)


def default_seconds(shape: Shape, step_s_512: float) -> float:
    """The registry's first estimate, before anything is learned: linear in pixels,
    steps and batch."""
    return step_s_512 * shape.steps * (shape.pixels / REFERENCE_PIXELS) * shape.batch


@dataclass(frozen=True)
class Durations:
    shapes: Mapping[str, Learned] = field(default_factory=dict)  # Shape.key -> seconds at speed 1
    speeds: Mapping[str, Learned] = field(default_factory=dict)  # worker id -> relative speed

    def shape_seconds(self, shape: Shape, step_s_512: float) -> float:
        """Learned for the shape; else scaled from the nearest batch size learned
        for the same model, size and steps (linearly: no batching gain is assumed
        before one is measured); else the registry's first estimate."""
        # A pass asks the same shape once per worker: the answer never changes
        # (durations are immutable), so it is worked out once.
        memo = self._shape_memo
        known = memo.get((shape.key, step_s_512))
        if known is None:
            known = memo[(shape.key, step_s_512)] = self._shape_seconds(shape, step_s_512)
        return known

    @cached_property
    def _shape_memo(self) -> dict[tuple[str, float], float]:
        return {}

    def _shape_seconds(self, shape: Shape, step_s_512: float) -> float:
        learned = self.shapes.get(shape.key)
        if learned:
            return learned.mean
        sizes = self._batch_sizes.get((shape.model, shape.pixels, shape.steps))
        if sizes:
            batch, mean = min(sizes, key=lambda s: (abs(s[0] - shape.batch), s[0]))
            return mean * shape.batch / batch
        return default_seconds(shape, step_s_512)

    @cached_property
    def _batch_sizes(self) -> dict[tuple[str, int, int], list[tuple[int, float]]]:
        sizes: dict[tuple[str, int, int], list[tuple[int, float]]] = {}
        for shape, learned in self._learned_shapes:
            sizes.setdefault((shape.model, shape.pixels, shape.steps), []).append((shape.batch, learned.mean))
        return sizes

    @cached_property
    def _learned_shapes(self) -> list[tuple[Shape, Learned]]:
        shapes = []
        for key, learned in self.shapes.items():
            model, pixels, steps, batch = key.rsplit("|", 3)
            shapes.append((Shape(model, int(pixels), int(steps), int(batch)), learned))
        return shapes

    def step_seconds(self, model: str, pixels: int, batch: int, step_s_512: float) -> float:
        """One denoising step of a batch of ``batch`` outputs of ``pixels`` each, on a
        speed-1.0 worker: learned from the shapes of that batch size whatever their
        steps (seconds over steps, weighted by how often each was seen: a member of
        a batch joined mid-way records its own steps and the batch's mean size);
        between learned batch sizes, linear in the batch (``along_batch``); with
        none learned for the model and size, the registry's first estimate."""
        memo = self._step_memo
        known = memo.get((model, pixels, batch, step_s_512))
        if known is None:
            learned = self._step_times.get((model, pixels))
            known = (
                along_batch(learned, batch) if learned else default_seconds(Shape(model, pixels, 1, batch), step_s_512)
            )
            memo[(model, pixels, batch, step_s_512)] = known
        return known

    @cached_property
    def _step_memo(self) -> dict[tuple[str, int, int, float], float]:
        return {}

    @cached_property
    def _step_times(self) -> dict[tuple[str, int], list[tuple[int, float]]]:
        """(batch size, seconds per step) learned per model and size, by batch size."""
        sums: dict[tuple[str, int], dict[int, tuple[float, int]]] = {}
        for shape, learned in self._learned_shapes:
            if shape.steps > 0 and shape.batch > 0 and learned.count > 0:
                by_batch = sums.setdefault((shape.model, shape.pixels), {})
                total, count = by_batch.get(shape.batch, (0.0, 0))
                by_batch[shape.batch] = (total + learned.mean / shape.steps * learned.count, count + learned.count)
        return {
            key: [(batch, total / count) for batch, (total, count) in sorted(by_batch.items())]
            for key, by_batch in sums.items()
        }

    @cached_property
    def _speed_scale(self) -> float:
        # Shapes and speeds are learned from the same observations, so only their
        # ratio is pinned down; without an anchor the common scale drifts. The mean
        # learned speed is held at 1.0: the unit shapes are learned in.
        means = [learned.mean for learned in self.speeds.values()]
        return len(means) / sum(means) if means and sum(means) > 0 else 1.0

    def speed(self, worker_id: str, declared: float = 1.0) -> float:
        learned = self.speeds.get(worker_id)
        return max(learned.mean * self._speed_scale, 1e-3) if learned else max(declared, 1e-3)

    def seconds(self, shape: Shape, step_s_512: float, worker_id: str, declared_speed: float = 1.0) -> float:
        return self.shape_seconds(shape, step_s_512) / self.speed(worker_id, declared_speed)


def along_batch(learned: Sequence[tuple[int, float]], batch: int) -> float:
    """A step's time at ``batch`` from (batch size, step time) learned, by batch
    size: linear between the learned sizes around it. Outside them, along the
    line through the two nearest, kept between a step that costs the same
    whatever the batch and one that grows in proportion to it (each image
    costing what it does at the nearest learned size): a batch's step never
    costs less than a smaller batch's, nor an image less than in a bigger
    batch. With one size learned, in proportion: no batching gain is assumed
    before one is measured."""
    for (b0, s0), (b1, s1) in itertools.pairwise(learned):
        if b0 <= batch <= b1:
            return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
    nearest_b, nearest_s = learned[0] if batch < learned[0][0] else learned[-1]
    proportional = nearest_s * batch / nearest_b
    if len(learned) == 1:
        return proportional
    (b0, s0), (b1, s1) = learned[:2] if batch < learned[0][0] else learned[-2:]
    line = s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
    return min(max(line, min(nearest_s, proportional)), max(nearest_s, proportional))


@dataclass(frozen=True)
class Observation:
    shape: Learned
    speed: Learned


def observe(
    durations: Durations,
    shape: Shape,
    step_s_512: float,
    worker_id: str,
    seconds: float,
    declared_speed: float = 1.0,
) -> Observation:
    """The new shape and worker entries after a job of ``shape`` took ``seconds``
    on ``worker_id``."""
    seconds = max(seconds, 1e-6)
    speed = durations.speed(worker_id, declared_speed)
    expected_at_1 = durations.shape_seconds(shape, step_s_512)
    old_shape = durations.shapes.get(shape.key)
    old_speed = durations.speeds.get(worker_id, Learned(speed, 0))
    new_shape = (old_shape or Learned(0.0, 0)).updated(seconds * speed)
    new_speed = old_speed.updated(expected_at_1 / seconds)
    return Observation(new_shape, new_speed)


def with_observation(durations: Durations, shape: Shape, worker_id: str, obs: Observation) -> Durations:
    return Durations(
        shapes={**durations.shapes, shape.key: obs.shape},
        speeds={**durations.speeds, worker_id: obs.speed},
    )


def learn(
    durations: Durations, observations: Iterable[tuple[Shape, str, float]], step_s_512: Mapping[str, float]
) -> Durations:
    """The table after learning from (shape, worker, seconds) observations, in
    order; models with no first estimate are passed over."""
    for shape, worker_id, seconds in observations:
        if shape.model in step_s_512:
            obs = observe(durations, shape, step_s_512[shape.model], worker_id, seconds)
            durations = with_observation(durations, shape, worker_id, obs)
    return durations
