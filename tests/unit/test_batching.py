"""What runs together on a sampler, and what stays in its memory: pure choices."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpu_worker.dispatch.batch_choice import PassArrivals, next_batch
from gpu_worker.models.residency import DoesNotFit, Resident, victims
from services.generation import BatchKey

A = BatchKey("sd15", 512, 512, 20, 7.5)
B = BatchKey("sd15", 512, 512, 30, 7.5)
MIB = 2**20


@dataclass(frozen=True)
class Held:
    key: BatchKey | None
    rows: int = 1


def max_rows(key: object) -> int:
    return 4


def test_batch_takes_the_oldest_and_later_jobs_of_its_key_in_order() -> None:
    inbox = [Held(A), Held(B), Held(A, 2), Held(A), Held(A)]
    chosen, full = next_batch(inbox, max_rows)
    assert chosen == [0, 2, 3]  # 1 + 2 + 1 rows: the fourth A would pass 4
    assert full


def test_a_partial_batch_is_not_full() -> None:
    chosen, full = next_batch([Held(B), Held(A)], max_rows)
    assert (chosen, full) == ([0], False)


def test_a_job_too_big_for_the_rest_leaves_room_for_smaller_ones() -> None:
    chosen, full = next_batch([Held(A, 3), Held(A, 2), Held(A, 1)], max_rows)
    assert (chosen, full) == ([0, 2], True)


def test_a_job_whose_key_is_unknown_runs_alone() -> None:
    assert next_batch([Held(None), Held(None)], max_rows) == ([0], True)


def test_eviction_goes_by_priority_then_least_recent_use() -> None:
    residents = [
        Resident("old-important", 4 * MIB, eviction_priority=5, last_used=1.0),
        Resident("recent", 4 * MIB, eviction_priority=0, last_used=9.0),
        Resident("old", 4 * MIB, eviction_priority=0, last_used=2.0),
    ]
    assert victims(4 * MIB, 0, residents) == ["old"]
    assert victims(8 * MIB, 0, residents) == ["old", "recent"]
    assert victims(12 * MIB, 0, residents) == ["old", "recent", "old-important"]


def test_eviction_counts_bytes_and_spares_what_fits_already() -> None:
    residents = [Resident("small", 1 * MIB, 0, 1.0), Resident("big", 6 * MIB, 0, 2.0)]
    assert victims(3 * MIB, 3 * MIB, residents) == []
    # Evicting the small one frees too little; the big one goes too.
    assert victims(8 * MIB, 2 * MIB, residents) == ["small", "big"]


def test_pinned_models_go_last() -> None:
    residents = [Resident("pinned", 4 * MIB, 0, 1.0, pinned=True), Resident("other", 4 * MIB, 9, 5.0)]
    assert victims(4 * MIB, 0, residents) == ["other"]


def test_a_model_bigger_than_everything_does_not_fit() -> None:
    with pytest.raises(DoesNotFit):
        victims(100 * MIB, 10 * MIB, [Resident("m", 10 * MIB, 0, 1.0)])


def test_a_worker_waits_for_the_rest_of_a_pass_and_for_nothing_else() -> None:
    arrivals = PassArrivals()
    assert arrivals.wait_s(0.0, 0.05) == 0  # nothing announced: no wait
    arrivals.arrived("p1", 3, now=10.0)
    assert arrivals.wait_s(10.01, 0.05) == pytest.approx(0.04)
    arrivals.arrived("p1", 3, now=10.02)
    arrivals.arrived("p1", 3, now=10.03)  # the third of three: the pass is whole
    assert arrivals.wait_s(10.03, 0.05) == 0
    arrivals.arrived("alone", 1, now=11.0)  # a pass of one job announces nothing to wait for
    arrivals.arrived("", 5, now=11.0)  # nor does a dispatch that names no pass
    assert arrivals.wait_s(11.0, 0.05) == 0


def test_a_pass_whose_jobs_never_all_come_is_given_up() -> None:
    arrivals = PassArrivals()
    arrivals.arrived("p1", 2, now=0.0)  # its other job was lost, or dropped as a duplicate
    assert arrivals.wait_s(0.01, 0.05) > 0
    assert arrivals.wait_s(0.06, 0.05) == 0
