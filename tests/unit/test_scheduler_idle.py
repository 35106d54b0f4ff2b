"""How long an idle scheduler waits between passes (scheduler/idle.py)."""

from __future__ import annotations

from scheduler.idle import next_idle_wait

FLOOR, CEILING = 0.05, 0.5


def waits(n: int, *, events: bool, woken_at: frozenset[int] = frozenset()) -> list[float]:
    wait, out = FLOOR, []
    for i in range(n):
        wait = next_idle_wait(wait, woken=i in woken_at, events=events, floor_s=FLOOR, ceiling_s=CEILING)
        out.append(wait)
    return out


def test_empty_passes_double_the_wait_up_to_the_ceiling_while_events_come() -> None:
    assert waits(6, events=True) == [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]


def test_an_event_brings_the_wait_back_to_the_floor() -> None:
    assert waits(6, events=True, woken_at=frozenset({3})) == [0.1, 0.2, 0.4, FLOOR, 0.1, 0.2]


def test_a_scheduler_that_hears_no_events_looks_at_the_floor_interval() -> None:
    assert waits(4, events=False) == [FLOOR] * 4


def test_a_ceiling_under_the_floor_keeps_the_floor() -> None:
    assert next_idle_wait(0.2, woken=False, events=True, floor_s=0.2, ceiling_s=0.1) == 0.2
