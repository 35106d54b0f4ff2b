"""Why a job must stop, as the sampler's tracker records it: a drain suspends what
is still sampling and leaves what is decoding to finish; the first reason wins."""

from __future__ import annotations

from gpu_worker.jobs.tracker import JobTracker, StopReason


def test_a_drain_suspends_only_what_is_still_sampling() -> None:
    tracker = JobTracker()
    sampling, decoding = tracker.open("a", 1), tracker.open("b", 1)
    decoding.sampled = True
    assert tracker.suspend_sampling(StopReason.SUSPENDED, "drain") == 1
    assert sampling.stopping.is_set() and sampling.suspending and not sampling.discards_work
    assert sampling.detail == "drain"
    assert not decoding.stopping.is_set()


def test_the_first_reason_wins_and_only_a_suspension_keeps_the_work() -> None:
    tracker = JobTracker()
    watch = tracker.open("a", 1)
    watch.stop(StopReason.CANCELLED)
    watch.stop(StopReason.PREEMPTED, "preempted for b")
    assert watch.stop_reason == StopReason.CANCELLED and watch.detail == ""
    assert watch.discards_work and not watch.suspending
    kept = {reason for reason in StopReason if reason.keeps_work}
    assert kept == {StopReason.SUSPENDED, StopReason.PREEMPTED}
