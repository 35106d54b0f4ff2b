"""The host cache's pure parts: which versions eviction takes, and paths made only
from checked names and digests."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from services.errors import ModelError
from services.models.host_cache.eviction import CachedVersion, Snapshot, to_evict, unreferenced
from services.models.host_cache.layout import Layout
from services.models.host_cache.origin import Lease, Step, next_step
from services.models.host_cache.peers import PeerSource, contiguous, rate_deadline
from services.models.host_cache.sources import BlobSourceFailed
from services.rpc.server import Channels

A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)


def version(name: str, used: float, blobs: set[str], *, held: bool = False) -> CachedVersion:
    return CachedVersion(name, "1", used, held, frozenset(blobs))


def test_nothing_is_evicted_within_the_capacity() -> None:
    snap = Snapshot([version("m", 1.0, {A})], {A: 10})
    assert to_evict(snap, capacity_bytes=10) == []


def test_the_least_recently_used_go_first_until_the_new_bytes_fit() -> None:
    old, mid, new = version("old", 1.0, {A}), version("mid", 2.0, {B}), version("new", 3.0, {C})
    snap = Snapshot([new, old, mid], {A: 10, B: 10, C: 10})
    assert to_evict(snap, capacity_bytes=30, need_bytes=5) == [old]
    assert to_evict(snap, capacity_bytes=30, need_bytes=15) == [old, mid]


def test_a_held_version_is_never_evicted_even_if_the_cache_stays_over() -> None:
    held, other = version("held", 1.0, {A}, held=True), version("other", 2.0, {B})
    snap = Snapshot([held, other], {A: 100, B: 10})
    assert to_evict(snap, capacity_bytes=50) == [other]


def test_a_blob_shared_with_a_remaining_version_frees_nothing() -> None:
    # "v1" and "v2" share A (90 bytes): evicting v1 frees only B; v2 must go too.
    v1, v2 = version("v1", 1.0, {A, B}), version("v2", 2.0, {A, C})
    snap = Snapshot([v1, v2], {A: 90, B: 5, C: 5})
    assert to_evict(snap, capacity_bytes=96) == [v1]
    assert to_evict(snap, capacity_bytes=50) == [v1, v2]


def test_unreferenced_blobs_count_as_free_already() -> None:
    snap = Snapshot([version("m", 1.0, {A})], {A: 10, D: 100})
    assert unreferenced(snap) == {D}
    assert to_evict(snap, capacity_bytes=10) == []


@pytest.mark.parametrize("digest", ["../" + "a" * 61, "A" * 64, "a" * 63, "a" * 64 + "/x", ""])
def test_a_blob_path_is_made_only_from_a_sha256_digest(tmp_path: Path, digest: str) -> None:
    layout = Layout(tmp_path)
    with pytest.raises(ModelError):
        layout.blob(digest)
    with pytest.raises(ModelError):
        layout.partial(digest)


@pytest.mark.parametrize("name", ["..", "../etc", "a/b", ".hidden", ""])
def test_a_model_path_is_made_only_from_a_checked_name(tmp_path: Path, name: str) -> None:
    layout = Layout(tmp_path)
    with pytest.raises(ModelError):
        layout.model(name, "1")
    with pytest.raises(ModelError):
        layout.model("m", name)


def test_the_host_id_is_made_once_per_cache_directory(tmp_path: Path) -> None:
    first, again, other = Layout(tmp_path / "h1"), Layout(tmp_path / "h1"), Layout(tmp_path / "h2")
    first.make()
    other.make()
    assert first.host_id() == again.host_id() != other.host_id()


# -- the origin lease's decision ----------------------------------------------------


def step(lease: Lease | None, *, peers_have: bool = False, waited_s: float = 0.0) -> Step:
    return next_step(peers_have=peers_have, lease=lease, own_host="me", waited_s=waited_s, patience_s=60.0)


def test_a_blob_a_peer_announces_comes_from_the_peer_whoever_holds_the_lease() -> None:
    assert step(None, peers_have=True) is Step.PEERS
    assert step(Lease("other", done=False), peers_have=True) is Step.PEERS


def test_no_lease_takes_it() -> None:
    assert step(None) is Step.TAKE


def test_another_hosts_lease_is_waited_on_until_the_patience_runs_out() -> None:
    assert step(Lease("other", done=False), waited_s=59.0) is Step.WAIT
    assert step(Lease("other", done=True), waited_s=59.0) is Step.WAIT  # done: its announcement is coming
    assert step(Lease("other", done=False), waited_s=60.0) is Step.STORE


def test_after_the_peers_that_announced_it_failed_the_store_is_read_once_the_origin_fetch_is_done() -> None:
    # Waiting for another announcement could take the whole patience (10 minutes).
    assert (
        next_step(
            peers_have=False,
            lease=Lease("other", done=True),
            own_host="me",
            waited_s=1.0,
            patience_s=600.0,
            peers_failed=True,
        )
        is Step.STORE
    )
    # The origin fetch still under way: its holder will announce it soon; wait for it.
    assert (
        next_step(
            peers_have=False,
            lease=Lease("other", done=False),
            own_host="me",
            waited_s=1.0,
            patience_s=600.0,
            peers_failed=True,
        )
        is Step.WAIT
    )


def test_this_hosts_own_unfinished_lease_is_a_dead_samplers_and_taken_over() -> None:
    assert step(Lease("me", done=False)) is Step.TAKE
    assert step(Lease("me", done=True), waited_s=1.0) is Step.WAIT


def test_a_cut_fetch_keeps_the_bytes_unbroken_from_the_start_to_the_byte() -> None:
    ranges = [(0, 16), (16, 32), (32, 40)]
    # No range finished: the first one's bytes are kept, the others' (beyond a hole) are not.
    assert contiguous(ranges, {0: 5, 16: 30, 32: 39}, 0) == 5
    # The first finished: on to as far as the second got.
    assert contiguous(ranges, {0: 16, 16: 20, 32: 40}, 0) == 20
    # A hole after a finished range stops the count there.
    assert contiguous(ranges, {0: 16, 16: 16, 32: 40}, 0) == 16
    assert contiguous(ranges, {0: 16, 16: 32, 32: 40}, 0) == 40
    # A resumed fetch counts from where it began.
    assert contiguous([(10, 16), (16, 20)], {10: 10, 16: 18}, 10) == 10


def test_a_peer_is_given_up_when_its_average_falls_under_the_minimum_past_the_grace() -> None:
    # 10 MB/s with a grace of 10 s: nothing yet, given up at 10 s (the idle limit's moment).
    assert rate_deadline(100.0, 0, grace_s=10.0, min_bytes_per_s=10e6) == 110.0
    # 50 MB in: it may wait 5 s more than that before falling under the line.
    assert rate_deadline(100.0, 50_000_000, grace_s=10.0, min_bytes_per_s=10e6) == 115.0
    # A fast start buys time against a later trickle, bounded by what it sent.
    assert rate_deadline(0.0, 10**9, grace_s=10.0, min_bytes_per_s=10e6) == 110.0
    assert rate_deadline(0.0, 10**9, grace_s=10.0, min_bytes_per_s=0.0) is None  # no minimum set


class _LateBytes(PeerSource):
    """A peer whose stream hands over one more chunk as the rate deadline cancels it,
    as a real stream does when a chunk is written while the deadline fires."""

    async def _read_range(
        self, stub: Any, digest: str, start: int, end: int, dest_fd: int, reached: Any, on_bytes: Any
    ) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            reached[start] = start + 1
            on_bytes()
            raise


async def test_bytes_that_land_as_the_rate_deadline_fires_still_give_the_peer_up(tmp_path: Path) -> None:
    channels = Channels()
    source = _LateBytes("127.0.0.1:1", channels, idle_s=0.05, min_bytes_per_s=1e6, range_bytes=10)
    dest = os.open(tmp_path / "blob", os.O_CREAT | os.O_WRONLY)
    try:
        with pytest.raises(BlobSourceFailed, match="under the minimum"):
            await source.fetch("a" * 64, 40, dest, 0)
    finally:
        os.close(dest)
        await channels.close()
