"""The demand the warm-set planner plans for: work submitted in the last window,
forecast per model and latency class (``forecast``), and sized for the fleet
(``Forecast.planning``). Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# How much of the latest change in demand the forecast carries forward: damped,
# as a full step doubles the noise of a half window's count.
TREND_WEIGHT = 0.5


@dataclass(frozen=True)
class Submitted:
    """Work submitted in the demand window, grouped: speed-1.0 seconds of it."""

    model: str
    seconds: float
    newer: bool  # submitted in the newer half of the window
    latency_bound: bool  # it has a latency target
    # Submitted before the window and still queued: a backlog, planned to be
    # worked off over the next window on top of the forecast.
    backlog: bool = False


@dataclass(frozen=True)
class Forecast:
    """Predicted work per second by model, for each latency class."""

    latency_bound: dict[str, float]
    best_effort: dict[str, float]

    @property
    def best_effort_models(self) -> frozenset[str]:
        """Models with best-effort demand and no latency-bound demand."""
        return frozenset(m for m in self.best_effort if m not in self.latency_bound)

    def planning(self, headroom: float, capacity: float) -> dict[str, float]:
        """What the plan sizes GPUs for: latency-bound work with ``headroom`` for
        bursts (its GPUs run at most 1 / headroom busy on the forecast), then
        best-effort work as forecast, scaled down to what the fleet's
        ``capacity`` (speed-1.0 seconds per second) has left, so that best-effort
        work gets the GPUs latency-bound work does not need and never the others."""
        bound = {m: headroom * d for m, d in self.latency_bound.items()}
        wanted = sum(self.best_effort.values())
        # The headroom is given up before half of what latency-bound work truly
        # leaves: a forecast over the fleet's capacity must not stop best-effort
        # work altogether.
        truly_left = capacity - sum(self.latency_bound.values())
        spare = max(capacity - sum(bound.values()), truly_left / 2, 0.0)
        scale = min(1.0, spare / wanted) if wanted > 0 else 1.0
        models = sorted({*self.latency_bound, *self.best_effort})
        return {m: bound.get(m, 0.0) + scale * self.best_effort.get(m, 0.0) for m in models}


def forecast(submitted: Sequence[Submitted], window_s: float) -> Forecast:
    """The demand of the next half window. Latency-bound demand follows its trend
    up (the newer half's rate plus ``TREND_WEIGHT`` of its change over the older
    half's), so a rising phase or a burst gets GPUs before its queue forms, and
    never falls below the whole window's mean (releasing GPUs on a dip would cost
    the next burst's tail). Best-effort demand is the window's mean: it has no
    latency to protect, and its few long jobs make its trend noise, which would
    move GPUs (and their loads) back and forth. Work still queued from before
    the window is added to either, to be worked off over the next window."""
    half = window_s / 2
    rates: dict[tuple[bool, str], list[float]] = {}
    for s in submitted:
        older_newer_backlog = rates.setdefault((s.latency_bound, s.model), [0.0, 0.0, 0.0])
        if s.backlog:
            older_newer_backlog[2] += s.seconds / window_s
        else:
            older_newer_backlog[1 if s.newer else 0] += s.seconds / half
    latency: dict[str, float] = {}
    best_effort: dict[str, float] = {}
    for (bound, model), (older, newer, backlog) in sorted(rates.items()):
        mean = (older + newer) / 2
        if bound:
            latency[model] = max(mean, newer + TREND_WEIGHT * (newer - older)) + backlog
        else:
            best_effort[model] = mean + backlog
    return Forecast(latency, best_effort)
