"""How long a scheduler with nothing placed waits before it looks again. Pure.

Work events on NATS (a submit, an outcome, a hand-back, a worker joining) wake it
at once; the wait is the safety net for an event lost. While the events come, the
net need not be fine: each empty pass doubles the wait, up to its ceiling, and any
event or placement brings it back to the floor. Without events (no subscription:
NATS away when the scheduler started) every wait is the floor, as the only way
work is found."""

from __future__ import annotations


def next_idle_wait(previous_s: float, *, woken: bool, events: bool, floor_s: float, ceiling_s: float) -> float:
    """The wait after an empty pass that waited ``previous_s``; ``woken``: an event
    ended that wait; ``events``: the scheduler hears work events at all."""
    if woken or not events:
        return floor_s
    return min(max(previous_s, floor_s) * 2, max(ceiling_s, floor_s))
