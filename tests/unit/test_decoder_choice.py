"""Which decoder a sampler sends latents to: the one that will finish them first,
from the load each heartbeats; in rotation while a speed is unknown."""

from __future__ import annotations

from typing import Any

from gpu_worker.decoding.decoder_choice import estimated_finish_s, fastest_first
from services.db.states import WorkerKind
from services.db.worker_records import WorkerRecord
from tests.records import worker_record


def decoder(worker_id: str, **telemetry: Any) -> WorkerRecord:
    return worker_record(
        worker_id,
        kind=WorkerKind.DECODER,
        address="127.0.0.1:1",
        models=("tiny",),
        warm_models=(),
        telemetry=telemetry,
    )


def ids(decoders: list[WorkerRecord]) -> list[str]:
    return [d.id for d in decoders]


def test_finish_is_the_work_held_plus_this_times_the_speed() -> None:
    busy = decoder("a", queued_megapixels=3.0, seconds_per_megapixel=0.5)
    assert estimated_finish_s(busy, 1.0) == 2.0
    # What this sampler sent since the last heartbeat counts, when the heartbeat lags.
    assert estimated_finish_s(busy, 1.0, in_flight=5.0) == 3.0
    assert estimated_finish_s(busy, 1.0, in_flight=1.0) == 2.0
    assert estimated_finish_s(decoder("b", queued_megapixels=0.0), 1.0) is None
    assert estimated_finish_s(decoder("c"), 1.0) is None


def test_the_decoder_that_finishes_first_goes_first() -> None:
    # A fast decoder with a queue against a slow idle one: the finish decides.
    fast_busy = decoder("fast", queued_megapixels=4.0, seconds_per_megapixel=0.1)  # (4 + 1) * 0.1 = 0.5 s
    slow_idle = decoder("slow", queued_megapixels=0.0, seconds_per_megapixel=1.0)  # 1 s
    assert ids(fastest_first([slow_idle, fast_busy], 1.0, {})) == ["fast", "slow"]
    fast_busier = decoder("fast", queued_megapixels=20.0, seconds_per_megapixel=0.1)  # 2.1 s
    assert ids(fastest_first([fast_busier, slow_idle], 1.0, {})) == ["slow", "fast"]
    # This sampler's own unreported work there moves it back too.
    assert ids(fastest_first([fast_busy, slow_idle], 1.0, {"fast": 20.0})) == ["slow", "fast"]


def test_ties_keep_the_rotation_and_an_unknown_speed_means_rotation() -> None:
    a = decoder("a", queued_megapixels=0.0, seconds_per_megapixel=0.2)
    b = decoder("b", queued_megapixels=0.0, seconds_per_megapixel=0.2)
    assert ids(fastest_first([b, a], 1.0, {})) == ["b", "a"]
    unmeasured = decoder("new")
    busy = decoder("busy", queued_megapixels=50.0, seconds_per_megapixel=1.0)
    assert ids(fastest_first([busy, unmeasured], 1.0, {})) == ["busy", "new"]
    assert ids(fastest_first([unmeasured, busy], 1.0, {})) == ["new", "busy"]
