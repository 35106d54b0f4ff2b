"""Placement and preemption settings: lanes, latency targets, best-effort classes,
caps and preemption, parsed once into objects. The scheduler and the gateway read
them from the environment, the simulator from a scenario's ``[darkroom]`` table:
the same fields, the same defaults, the same errors."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from services.config.fields import Codec, Section, SettingsError, name_of, setting


@dataclass(frozen=True)
class Lane:
    name: str
    priority: int
    # Backpressure: a submit whose estimated wait passes this is refused.
    max_wait_s: float = math.inf
    # Latency target: seconds from submit to done that the lane's jobs should meet
    # (at p99). None: best effort (throughput only).
    target_s: float | None = None


def _positive(value: Any) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{value!r} is not a positive number of seconds")
    return seconds


def _lane_entry(fields: list[str]) -> Lane:
    name, priority, *rest = (f.strip() for f in fields)
    if len(rest) > 2 or not name:
        raise ValueError(fields)
    max_wait = float(rest[0]) if rest else math.inf
    return Lane(name, int(priority), max_wait, _positive(rest[1]) if len(rest) > 1 else None)


def _lanes_from_text(raw: str) -> tuple[Lane, ...]:
    lanes = []
    for entry in raw.split(","):
        if entry.strip():
            try:
                lanes.append(_lane_entry(entry.split(":")))
            except ValueError:
                raise ValueError(
                    f"entry {entry.strip()!r}: expected name:priority[:max_wait_s[:target_s]], target_s > 0"
                ) from None
    return tuple(lanes)


def _lanes_from_toml(table: Any) -> tuple[Lane, ...]:
    if not isinstance(table, dict):
        raise ValueError("expected a table of lanes, each {priority, max_wait_s, target_s}")
    lanes = []
    for name, lane in table.items():
        unknown = sorted(set(lane) - {"priority", "max_wait_s", "target_s"}) if isinstance(lane, dict) else None
        if unknown is None or unknown or "priority" not in lane:
            raise ValueError(f"lane {name!r}: expected {{priority, max_wait_s, target_s}}")
        target = _positive(lane["target_s"]) if "target_s" in lane else None
        lanes.append(Lane(name, int(lane["priority"]), float(lane.get("max_wait_s", math.inf)), target))
    return tuple(lanes)


def _lane_text(lane: Lane) -> str:
    text = f"{lane.name}:{lane.priority}:{lane.max_wait_s:g}"
    return text + (f":{lane.target_s:g}" if lane.target_s is not None else "")


LANES = Codec(
    "lanes: name:priority[:max_wait_s[:target_s]], comma-separated",
    _lanes_from_text,
    _lanes_from_toml,
    lambda lanes: ",".join(_lane_text(lane) for lane in lanes),
)


def _pairs(kind: str, value: Any) -> Codec:
    """``capability:value`` entries (a TOML table of them), each value read by ``value``."""

    def from_text(raw: str) -> tuple[tuple[str, Any], ...]:
        pairs = []
        for entry in raw.split(","):
            if entry.strip():
                try:
                    name, number = entry.split(":")
                    pairs.append((name.strip(), value(number)))
                except ValueError:
                    raise ValueError(f"entry {entry.strip()!r}: expected capability:{kind}") from None
        return tuple(pairs)

    def from_toml(table: Any) -> tuple[tuple[str, Any], ...]:
        if not isinstance(table, dict):
            raise ValueError(f"expected a table of capability = {kind}")
        return tuple((name, value(number)) for name, number in table.items())

    return Codec(
        f"capability:{kind}, comma-separated", from_text, from_toml, lambda ps: ",".join(f"{c}:{v:g}" for c, v in ps)
    )


TARGETS = _pairs("target_s", _positive)
CAPS = _pairs("gpus", int)


# Shipped as best effort whether or not a model of the fleet serves it yet.
DEFAULT_BEST_EFFORT = frozenset({"video"})


@dataclass(frozen=True)
class PlacementSettings(Section):
    """How the scheduler places jobs (and the gateway estimates their wait)."""

    lanes: tuple[Lane, ...] = setting(
        (Lane("paid", 10, 120.0, 10.0), Lane("free", 0, 300.0, 30.0)),
        "Priority lanes. Higher priority goes first; a submit whose estimated wait passes its lane's max_wait_s "
        "is refused with RESOURCE_EXHAUSTED and a RetryInfo; an empty lane means the lowest one. A lane with a "
        "target_s (p99 seconds, submit to done) is latency-bound: its work goes before best-effort work, "
        "earliest deadline first.",
        codec=LANES,
    )
    best_effort: frozenset[str] = setting(
        DEFAULT_BEST_EFFORT,
        "Capabilities or lanes whose work is best effort whatever its lane's target (video, batch work): it takes "
        "the GPUs latency-bound work does not need.",
    )
    capability_targets: tuple[tuple[str, float], ...] = setting(
        (), "Latency targets of capabilities, tighter than their lane's (e.g. upscale:5).", codec=TARGETS
    )
    capability_caps: tuple[tuple[str, int], ...] = setting(
        (),
        "An operator's override: at most this many GPUs hold work of a capability while other work is queued or "
        "running (e.g. video:3).",
        codec=CAPS,
    )
    latency_headroom: float = setting(
        1.3,
        "The warm-set plan gives latency-bound work GPUs for this multiple of its forecast demand (room for bursts).",
        at_least=1.0,
    )
    aging_per_s: float = setting(
        0.5,
        "Priority a waiting job gains per second, so that no lane starves (free overtakes a fresh paid job after "
        "10 / 0.5 = 20 s).",
        env="LANE_AGING_PER_S",
        at_least=0.0,
    )
    backlog_limit: int = setting(
        2,
        "Jobs a worker may hold beyond the one it runs; the rest wait centrally (late binding).",
        env="WORKER_BACKLOG",
        at_least=0,
    )
    hot_c: float = setting(
        70.0,
        "Above this temperature a GPU's queued work counts more (twice at hot_c + hot_span_c).",
        env="HOT_TEMPERATURE_C",
    )
    hot_span_c: float = setting(10.0, "Degrees above hot_c at which a GPU's queued work counts twice.", at_least=0.1)
    adapter_load_s: float = setting(
        0.5,
        "Seconds a sampler is taken to spend loading a LoRA adapter not resident on its device, until it has "
        "measured its own (its heartbeat's adapter_load_s).",
        at_least=0.0,
    )
    spill_within: float = setting(
        2.5,
        "Late binding: a job waits for a busy worker rather than start on a warm one with room only when it is "
        "estimated to finish more than this many times sooner there.",
        at_least=1.0,
    )
    fair_share: bool = setting(
        True,
        "Within a lane, tenants take turns by weight and recent GPU-seconds: a tenant that used less, for its "
        "weight, goes first (the lane keeps its turns; work-conserving).",
    )
    fair_share_half_life_s: float = setting(
        600.0,
        "How fast a tenant's GPU-seconds are forgotten for fair sharing: they count half after this long.",
        at_least=1.0,
    )
    estimates_refresh_s: float = setting(
        2.0,
        "How often the scheduler and the gateway reread learned durations and speeds (production only).",
        at_least=0.0,
    )

    def check(self) -> None:
        if not self.lanes:
            raise SettingsError(f"{name_of(PlacementSettings, 'lanes')} names no lane")

    def lane(self, name: str) -> Lane | None:
        return next((lane for lane in self.lanes if lane.name == name), None)

    @property
    def default_lane(self) -> Lane:
        return min(self.lanes, key=lambda lane: lane.priority)

    def target_s(self, lane: str, capability: str) -> float | None:
        """The latency target of work of ``capability`` in ``lane``, or None for
        best-effort work: the tighter of the lane's and the capability's targets,
        unless either is listed as best effort."""
        if lane in self.best_effort or capability in self.best_effort:
            return None
        found = self.lane(lane)
        targets = [t for t in (found.target_s if found else None, dict(self.capability_targets).get(capability)) if t]
        return min(targets) if targets else None

    @property
    def has_targets(self) -> bool:
        return any(lane.target_s for lane in self.lanes) or bool(self.capability_targets)

    def plans_as_latency_bound(self, target_s: float | None) -> bool:
        """Whether the warm-set plan counts work with ``target_s`` as latency-bound:
        all of it where nothing has a target, so the plan is what it was before
        latency classes."""
        return target_s is not None or not self.has_targets

    def cap(self, capability: str) -> int | None:
        return dict(self.capability_caps).get(capability)


@dataclass(frozen=True)
class PreemptionSettings(Section):
    """Which running jobs may be suspended at a step (checkpointed, back to the queue,
    no attempt counted) for which waiting ones: by default, best-effort work for a
    job that would miss its latency target."""

    preemptible: frozenset[str] = setting(
        frozenset(), "Lanes or capabilities whose running jobs may be suspended for waiting jobs of preempting_lanes."
    )
    preempting_lanes: frozenset[str] = setting(frozenset(), "Lanes whose waiting jobs may suspend preemptible work.")
    max_preemptions: int = setting(2, "A job is never suspended for other work more often than this.", at_least=0)
    preempt_after_s: float = setting(
        2.0, "A waiting job preempts only when it would otherwise wait longer than this.", at_least=0.0
    )
    for_targets: bool = setting(
        True,
        "Latency classes decide too: a job with a latency target it would miss may suspend best-effort work.",
        env="PREEMPT_FOR_TARGETS",
    )
    target_share: float = setting(
        0.3,
        "... when its estimated finish passes this share of its target (the estimate is a mean, the target a p99).",
        env="PREEMPT_TARGET_SHARE",
        at_least=0.01,
        at_most=1.0,
    )

    @property
    def enabled(self) -> bool:
        listed = bool(self.preemptible) and bool(self.preempting_lanes)
        return (listed or self.for_targets) and self.max_preemptions > 0

    def may_preempt(self, lane: str, target_s: float | None = None) -> bool:
        """Whether a waiting job of ``lane`` (with latency target ``target_s``)
        may have running work suspended for it."""
        return self.enabled and (lane in self.preempting_lanes or (self.for_targets and target_s is not None))


def check_names(
    placement: PlacementSettings, preemption: PreemptionSettings, capabilities: Collection[str] | None = None
) -> None:
    """What placement and preemption name must exist: preempting lanes are lanes; a
    preemptible entry is no preempting lane (its jobs are never preempted, so the
    entry could only mislead); and, when the models' ``capabilities`` are known,
    best-effort and preemptible entries are lanes or capabilities (or a default's
    capability, which no model may serve yet)."""
    lanes = [lane.name for lane in placement.lanes]
    for name in sorted(preemption.preempting_lanes):
        if name not in lanes:
            raise SettingsError(
                f"{name_of(PreemptionSettings, 'preempting_lanes')} names {name!r}, which is not a lane of "
                f"{name_of(PlacementSettings, 'lanes')} ({', '.join(lanes)})"
            )
    for name in sorted(preemption.preemptible & preemption.preempting_lanes):
        raise SettingsError(
            f"{name_of(PreemptionSettings, 'preemptible')} names {name!r}, which is in "
            f"{name_of(PreemptionSettings, 'preempting_lanes')}: a preempting lane's jobs are never preempted"
        )
    if capabilities is None:
        return
    known = {*lanes, *capabilities, *DEFAULT_BEST_EFFORT}
    checked: Iterable[tuple[type, str, frozenset[str]]] = (
        (PlacementSettings, "best_effort", placement.best_effort),
        (PreemptionSettings, "preemptible", preemption.preemptible),
    )
    for owner, field_name, names in checked:
        for name in sorted(names - known):
            raise SettingsError(
                f"{name_of(owner, field_name)} names {name!r}, which is neither a lane nor a model capability"
            )
