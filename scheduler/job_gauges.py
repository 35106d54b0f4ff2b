"""Jobs not yet ended by state and lane, and each lane's queue, as Prometheus
gauges: counted in PostgreSQL every few seconds from the indexes of queued and held
jobs. Every scheduler replica reports the same figures (take ``max`` across them),
whichever one places the jobs. Jobs that ended are counted as they end
(``darkroom_jobs_finished_total``), by the service that ended them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from scheduler.metrics import JOBS, QUEUE_DEPTH, QUEUE_OLDEST
from services.db.counts import LaneCount
from services.db.repository import Repository
from services.db.states import JobStatus
from services.errors import StoreError

log = logging.getLogger(__name__)

# Often enough for a dashboard.
REFRESH_S = 5.0
ACTIVE = tuple(status for status in JobStatus if not status.terminal)


def show(counts: Sequence[LaneCount], lanes: Iterable[str], *, now: datetime) -> set[str]:
    """Sets the gauges from the counts: every state of every lane, 0 where there
    is no job, so that a lane that empties reads 0, not its last count. Returns
    the lanes shown (the configured ones and any found)."""
    shown = {*lanes, *(c.lane for c in counts)}
    by_key = {(c.status, c.lane): c for c in counts}
    for lane in shown:
        for status in ACTIVE:
            found = by_key.get((status, lane))
            JOBS.labels(state=status.value, lane=lane).set(found.count if found else 0)
        queued = by_key.get((JobStatus.QUEUED, lane))
        QUEUE_DEPTH.labels(lane=lane).set(queued.count if queued else 0)
        QUEUE_OLDEST.labels(lane=lane).set(max(0.0, (now - queued.oldest).total_seconds()) if queued else 0.0)
    return shown


async def job_gauges_loop(
    repo: Repository, lanes: Iterable[str], stop: asyncio.Event, every_s: float = REFRESH_S
) -> None:
    """Refreshes the gauges until ``stop``. While the database is away they keep
    their last values: an outage is no empty queue."""
    shown = set(lanes)
    while not stop.is_set():
        try:
            shown = show(await repo.jobs.counts_by_lane(), shown, now=datetime.now(UTC))
        except StoreError as exc:
            log.warning("cannot count jobs for the metrics, will retry: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
