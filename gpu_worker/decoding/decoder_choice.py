"""Which decoder service a batch's latents go to first: the one that will finish
them soonest by its heartbeated load and measured speed (pure; the sampler's
``Decoders`` does the calls)."""

from __future__ import annotations

from services import reported
from services.db.worker_records import WorkerRecord


def estimated_finish_s(decoder: WorkerRecord, megapixels: float, in_flight: float = 0.0) -> float | None:
    """When ``decoder`` would finish ``megapixels`` more, from its heartbeated load:
    the work it holds (at least ``in_flight``, what this sampler has sent it since)
    times its measured seconds per megapixel. None while its speed is unknown."""
    speed = reported.number(decoder.telemetry, "seconds_per_megapixel")
    if speed <= 0:
        return None
    held = max(reported.number(decoder.telemetry, "queued_megapixels"), in_flight)
    return (held + megapixels) * speed


def fastest_first(decoders: list[WorkerRecord], megapixels: float, in_flight: dict[str, float]) -> list[WorkerRecord]:
    """``decoders`` by estimated finish, ties in the given order; in the given order
    (a rotation) while any of them has no measured speed, so that each gets measured."""
    finish = [estimated_finish_s(d, megapixels, in_flight.get(d.id, 0.0)) for d in decoders]
    known = [f for f in finish if f is not None]
    if len(known) < len(decoders):
        return decoders
    return [decoders[i] for i in sorted(range(len(decoders)), key=known.__getitem__)]
