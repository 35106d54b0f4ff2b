"""The leader's watchdog over plain data: a batch across the group is stuck when no
step boundary came for the floor, or for ten of its slowest steps if longer; nothing
is stuck between batches."""

from __future__ import annotations

import threading

from gpu_worker.group.watchdog import StallWatch, watch


def test_a_batch_with_no_boundary_past_the_floor_is_stuck() -> None:
    stall = StallWatch(floor_s=60.0)
    assert stall.stalled(1000.0) is None  # no batch
    stall.began(0.0)
    assert stall.stalled(59.0) is None
    assert stall.stalled(61.0) == 61.0
    stall.ended()
    assert stall.stalled(1000.0) is None


def test_slow_steps_raise_the_bar_to_ten_of_them() -> None:
    stall = StallWatch(floor_s=60.0)
    stall.began(0.0)
    stall.boundary(20.0)  # a 20 s step (a video's): ten of them before it is stuck
    assert stall.stalled(20.0 + 150.0) is None
    assert stall.stalled(20.0 + 201.0) == 201.0
    stall.began(500.0)  # a new batch: its own steps
    assert stall.stalled(561.0) == 61.0


def test_the_watchdog_calls_out_a_stall_and_stops() -> None:
    stall, lock, stop, called = StallWatch(floor_s=1.0), threading.Lock(), threading.Event(), threading.Event()
    stall.began(0.0)  # long ago, on the monotonic clock
    thread = threading.Thread(target=watch, args=(stall, lock, stop, called.set))
    thread.start()
    assert called.wait(5.0)
    thread.join(5.0)
    assert not thread.is_alive()
