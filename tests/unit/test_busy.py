"""The sampler's busy account (gpu_worker.busy), on a clock of its own: denoising
over the time work waited, the host's gaps between consecutive batches, and nothing
counted while no work waits (a model's warm-up, idle time)."""

from __future__ import annotations

from gpu_worker.busy import BusyClock


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def denoise(busy: BusyClock, clock: Clock, began: float, ended: float) -> None:
    clock.now = began
    with busy.denoising():
        clock.now = ended


def test_denoising_over_the_time_work_waited_with_the_gaps_between_batches() -> None:
    clock = Clock()
    busy = BusyClock(clock)
    denoise(busy, clock, 0.0, 2.0)  # a warm-up, before any work: not counted
    clock.now = 10.0
    busy.work(True)
    denoise(busy, clock, 10.1, 11.1)  # the first batch starts 0.1 s after work arrived: no gap
    denoise(busy, clock, 11.15, 12.15)  # 50 ms of host time between batches
    clock.now = 12.2
    busy.work(False)
    clock.now = 100.0  # idle time counts for nothing
    busy.work(True)
    denoise(busy, clock, 100.0, 101.0)  # after idling: no gap either
    clock.now = 101.0
    busy.work(False)
    reading = busy.reading()
    assert reading.denoising_s == 3.0
    assert round(reading.waiting_s, 6) == 3.2
    assert reading.batches == 3
    assert round(reading.gaps_s, 6) == 0.05
    assert round(reading.ratio, 6) == round(3.0 / 3.2, 6)


def test_a_reading_counts_the_work_waiting_and_the_batch_denoising_up_to_now() -> None:
    clock = Clock()
    busy = BusyClock(clock)
    assert busy.reading().ratio == 1.0, "no work yet"
    busy.work(True)
    denoise(busy, clock, 0.0, 0.5)
    clock.now = 1.0
    assert busy.reading().waiting_s == 1.0
    clock.now = 2.0
    assert busy.reading().waiting_s == 2.0
    assert busy.reading().ratio == 0.25
    with busy.denoising():  # a batch under way counts as far as it has gone
        clock.now = 4.0
        reading = busy.reading()
        assert (reading.denoising_s, reading.waiting_s, reading.batches) == (2.5, 4.0, 1)
