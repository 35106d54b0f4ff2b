"""A job's stages, from the timestamps its attempt leaves on it: what GetJob shows,
what the sampler's metrics observe and what the benchmark reports, all the same.

queue     created to placed by the scheduler (a retried job: to its latest placement)
schedule  placed to published to its worker
dispatch  published to started on the worker (JetStream, the worker's batching)
sample    started to latents out (the denoising loop)
decode    latents out to images decoded
store     images decoded to the result written (the database's clock; its commit follows)
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

STAGES = ("queue", "schedule", "dispatch", "sample", "decode", "store")


def durations(times: Sequence[datetime | None]) -> dict[str, float]:
    """Seconds in each stage whose start and end are both known, from the times in
    order: created, scheduled, dispatched, started, decoding, decoded, finished;
    ``total`` from created to finished when both are known. A clock step between
    hosts never makes a stage negative."""
    out = {
        stage: max(0.0, (end - start).total_seconds())
        for stage, start, end in zip(STAGES, times, times[1:], strict=False)
        if start is not None and end is not None
    }
    if times[0] is not None and times[-1] is not None:
        out["total"] = max(0.0, (times[-1] - times[0]).total_seconds())
    return out
