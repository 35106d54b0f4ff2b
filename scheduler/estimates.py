"""How long a job takes: defaults per model, learned online from completed jobs.

A duration is learned per *shape* (model, pixels, steps, batch) in seconds on a
speed-1.0 worker, and each worker's speed is learned from how its jobs compare
with those shapes. The estimate of a job on a worker is the shape's duration over
the worker's speed. Both are running means that turn into exponential averages
after ``WARMUP`` observations, so they follow a GPU that slows down (heat, a
noisy neighbour) without forgetting everything at once.

Pure: a frozen table in, a new entry out. The scheduler and the simulator read
the same table; workers record how long each job ran, and the scheduler folds
those run times in and stores the table, so estimates survive restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
        for key, learned in self.shapes.items():
            model, pixels, steps, batch = key.rsplit("|", 3)
            sizes.setdefault((model, int(pixels), int(steps)), []).append((int(batch), learned.mean))
        return sizes

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
