"""The presence view (services/presence_view.py) as plain data on a clock the test
moves: heartbeats folded in as they arrive, liveness judged by when they arrived,
values that predate the watch aged by their timestamps, warm plans merged into
the samplers they are for, and nothing judged until the view has settled."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gateway.fleet_messages import worker_stats
from gpu_worker.decoding.decoder_choice import estimated_finish_s
from scheduler import facts
from services.bus.presence_board import Announcement, decode_plan, encode_plan, plan_key, worker_key
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import WarmPlan, WorkerHeartbeat
from services.models.host_cache.peers import holders
from services.presence_view import PresenceView


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def announcement(
    worker_id: str, kind: WorkerKind = WorkerKind.SAMPLER, status: WorkerStatus = WorkerStatus.READY
) -> Announcement:
    hb = WorkerHeartbeat(
        worker_id,
        kind,
        f"10.0.0.1:{len(worker_id)}",
        "cpu",
        ("tiny",),
        ("tiny",),
        vram_total_bytes=8,
        status=status,
        restarts=2,
        telemetry={"inflight": 3},
        capabilities=("image",),
    )
    return Announcement(hb, "inc-1", 1_700_000_000.0)


def put(view: PresenceView, a: Announcement, *, age_s: float = 0.0) -> None:
    view.fold(worker_key(a.heartbeat.kind, a.heartbeat.id), a.encode(), age_s=age_s)


def test_an_announcement_survives_its_encoding() -> None:
    a = announcement("w1")
    assert Announcement.decode(a.encode()) == a
    assert decode_plan(encode_plan(WarmPlan("tiny", ("tiny", "sd")))) == WarmPlan("tiny", ("tiny", "sd"))
    with pytest.raises(ValueError, match="malformed"):
        Announcement.decode(b'{"heartbeat": {"kind": "sampler"}}')


def test_a_worker_is_live_until_its_heartbeats_stop_arriving() -> None:
    clock = Clock()
    view = PresenceView((WorkerKind.SAMPLER,), clock=clock)
    put(view, announcement("w1"))
    put(view, announcement("w2"))
    [w1, _] = view.live(WorkerKind.SAMPLER, stale_after_s=10)
    assert (w1.id, w1.address, w1.restarts, w1.telemetry, w1.capabilities) == (
        "w1",
        "10.0.0.1:2",
        2,
        {"inflight": 3},
        ("image",),
    )
    clock.now += 8
    put(view, announcement("w2"))
    clock.now += 4
    assert [w.id for w in view.live(WorkerKind.SAMPLER, stale_after_s=10)] == ["w2"]
    assert [(w.id, w.live) for w in view.all(WorkerKind.SAMPLER, stale_after_s=10)] == [("w1", False), ("w2", True)]
    assert view.fresh(WorkerKind.SAMPLER, stale_after_s=10) == {"w2": 4.0}
    assert view.ages(WorkerKind.SAMPLER) == {"w1": 12.0, "w2": 4.0}


def test_only_ready_workers_take_work_and_a_stopped_one_says_so() -> None:
    view = PresenceView((WorkerKind.SAMPLER,), clock=Clock())
    put(view, announcement("w1", status=WorkerStatus.DRAINING))
    put(view, announcement("w2", status=WorkerStatus.GONE))
    assert view.live(WorkerKind.SAMPLER, stale_after_s=10) == []
    assert {w.id: w.status for w in view.all(WorkerKind.SAMPLER, stale_after_s=10)} == {
        "w1": WorkerStatus.DRAINING,
        "w2": WorkerStatus.GONE,
    }


def test_values_older_than_the_watch_count_their_age() -> None:
    clock = Clock()
    view = PresenceView((WorkerKind.SAMPLER,), clock=clock)
    put(view, announcement("w1"), age_s=30)
    put(view, announcement("w2"), age_s=-5)  # a server clock ahead of this host's: never younger than now
    assert view.age_s(WorkerKind.SAMPLER, "w1") == 30 and view.age_s(WorkerKind.SAMPLER, "w2") == 0
    assert [w.id for w in view.live(WorkerKind.SAMPLER, stale_after_s=10)] == ["w2"]


def test_a_plan_is_merged_into_its_sampler_and_a_deletion_forgets() -> None:
    view = PresenceView((WorkerKind.SAMPLER,), clock=Clock())
    put(view, announcement("w1"))
    view.fold(plan_key("w1"), encode_plan(WarmPlan("tiny", ("tiny",))))
    [w1] = view.live(WorkerKind.SAMPLER, stale_after_s=10)
    assert (w1.primary_model, w1.planned_models) == ("tiny", ("tiny",))
    assert view.plan("w1") == WarmPlan("tiny", ("tiny",))
    view.fold(worker_key(WorkerKind.SAMPLER, "w1"), None)
    assert view.get(WorkerKind.SAMPLER, "w1") is None and view.age_s(WorkerKind.SAMPLER, "w1") is None


def test_other_kinds_malformed_values_and_borrowed_keys_are_ignored() -> None:
    view = PresenceView((WorkerKind.DECODER,), clock=Clock())
    put(view, announcement("s1", WorkerKind.SAMPLER))
    view.fold("decoder.d1", b"not json")
    view.fold("decoder.d2", announcement("d3", WorkerKind.DECODER).encode())  # a key must name its own worker
    put(view, announcement("d1", WorkerKind.DECODER))
    assert [w.id for w in view.all(WorkerKind.DECODER, stale_after_s=10)] == ["d1"]
    assert view.all(WorkerKind.SAMPLER, stale_after_s=10) == []


def test_nothing_is_judged_until_the_view_has_settled_for_long_enough() -> None:
    clock = Clock()
    view = PresenceView((WorkerKind.SAMPLER,), clock=clock)
    assert not view.settled_for(0)
    view.settled()
    clock.now += 5
    assert view.settled_for(5) and not view.settled_for(10)
    view.unsettled()  # NATS went away: start over
    clock.now += 100
    assert not view.settled_for(0)
    view.settled()
    view.settled()  # settling again does not restart the count
    clock.now += 10
    assert view.settled_for(10)


def test_a_view_of_one_kind_watches_only_that_kinds_keys() -> None:
    assert PresenceView((WorkerKind.DECODER,)).keys == "decoder.>"
    assert PresenceView((WorkerKind.SAMPLER, WorkerKind.DECODER)).keys == ">"  # and the plans


def test_a_decoder_key_never_speaks_for_a_sampler_of_the_same_id() -> None:
    """The decoders' NATS user may write any ``decoder.*`` key: what it writes
    under ``decoder.gpu-7`` is a decoder's, or nothing, never sampler gpu-7's."""
    clock = Clock()
    view = PresenceView((WorkerKind.SAMPLER, WorkerKind.DECODER), clock=clock)
    put(view, announcement("gpu-7"))
    view.fold(plan_key("gpu-7"), encode_plan(WarmPlan("tiny", ("tiny",))))
    [sampler] = view.all(WorkerKind.SAMPLER, stale_after_s=10)
    forged = replace(announcement("gpu-7").heartbeat, address="10.6.6.6:1", telemetry={"cached": ["evil"]})
    decoder_key = worker_key(WorkerKind.DECODER, "gpu-7")
    clock.now += 1
    # A sampler's heartbeat under a decoder's key: refused.
    view.fold(decoder_key, Announcement(forged, "forged", 0.0).encode())
    assert view.all(WorkerKind.SAMPLER, stale_after_s=10) == [sampler]
    assert view.all(WorkerKind.DECODER, stale_after_s=10) == []
    # A decoder's heartbeat with the sampler's id: a decoder of that id, apart from the sampler.
    view.fold(decoder_key, Announcement(replace(forged, kind=WorkerKind.DECODER), "forged", 0.0).encode())
    assert view.all(WorkerKind.SAMPLER, stale_after_s=10) == [sampler]
    [decoder] = view.all(WorkerKind.DECODER, stale_after_s=10)
    assert (decoder.id, decoder.address, decoder.planned_models) == ("gpu-7", "10.6.6.6:1", ())
    assert view.ages(WorkerKind.SAMPLER) == {"gpu-7": 1.0}  # the decoder's beat is not the sampler's
    # Its deletion: the decoder goes, the sampler stays, heard from as it was.
    view.fold(decoder_key, None)
    assert view.all(WorkerKind.DECODER, stale_after_s=10) == []
    assert [w.id for w in view.live(WorkerKind.SAMPLER, stale_after_s=10)] == ["gpu-7"]
    assert view.ages(WorkerKind.SAMPLER) == {"gpu-7": 1.0}
    assert view.ages(WorkerKind.DECODER) == {}
    # The sampler's own key still speaks for it.
    view.fold(worker_key(WorkerKind.SAMPLER, "gpu-7"), None)
    assert view.all(WorkerKind.SAMPLER, stale_after_s=10) == []


def mangled(a: Announcement, path: str, value: object) -> bytes:
    """``a`` encoded with the field at ``path`` ("heartbeat.speed") set to ``value``."""
    body = json.loads(a.encode())
    *parents, name = path.split(".")
    target = body
    for parent in parents:
        target = target[parent]
    target[name] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("started_at", 1e300),  # datetime.fromtimestamp overflows
        ("started_at", "yesterday"),
        ("heartbeat.vram_total_bytes", "x"),
        ("heartbeat.vram_used_bytes", -1),
        ("heartbeat.restarts", 2**40),  # past the uint32 GetStats sends
        ("heartbeat.speed", 0),  # a divisor
        ("heartbeat.temperature_c", True),
        ("heartbeat.telemetry", [1, 2]),
        ("heartbeat.models", "tiny"),
        ("heartbeat.capabilities", [1]),
        ("heartbeat.id", 7),
        ("heartbeat.extra", 1),
        ("heartbeat", []),
    ],
)
def test_a_malformed_heartbeat_is_refused_and_the_view_goes_on(path: str, value: object) -> None:
    view = PresenceView((WorkerKind.SAMPLER,), clock=Clock())
    a = announcement("w1")
    with pytest.raises(ValueError, match="malformed announcement"):
        Announcement.decode(mangled(a, path, value))
    view.fold(worker_key(WorkerKind.SAMPLER, "w1"), mangled(a, path, value))
    assert view.get(WorkerKind.SAMPLER, "w1") is None
    put(view, a)
    assert view.get(WorkerKind.SAMPLER, "w1") is not None


def test_telemetry_a_worker_would_not_send_is_read_as_unknown_by_everyone_who_reads_it() -> None:
    """A well-formed heartbeat whose telemetry holds what no worker of this version
    sends: the scheduler's facts, a sampler's choice of decoder and peer, and an
    admin's GetStats read each such value as absent, and never fail."""
    telemetry = {
        "models": {"tiny": {"bytes": "big", "load_s": float("inf")}},
        "open_seats": "many",
        "inflight": "3",
        "seconds_per_megapixel": "fast",
        "queued_megapixels": [1],
        "sm_clock_mhz": -5,
        "queued_images": 2**40,
        "throttle_reasons": 7,
        "utilization_pct": "high",
        "model_cache": {"host": "h2", "blobs": "ab"},
    }
    a = announcement("w1")
    view = PresenceView((WorkerKind.SAMPLER,), clock=Clock())
    put(view, replace(a, heartbeat=replace(a.heartbeat, telemetry=telemetry)))
    record = view.get(WorkerKind.SAMPLER, "w1")
    assert record is not None
    fact = facts.worker(record)
    assert fact.measured == (("tiny", 0, 0.0),) and fact.open_seats == ()
    assert estimated_finish_s(record, 1.0) is None
    assert [w.id for w in holders([record], "ab" * 32, "h1")] == []
    stats = worker_stats(record, 0)
    assert (stats.sm_clock_mhz, stats.queued_images, list(stats.throttle_reasons)) == (0, 0, [])
    assert stats.utilization_pct == 0.0
