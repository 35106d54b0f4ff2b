"""The fleet as its heartbeats tell it, kept up to date from the presence bucket
(``services.bus.presence_board``): the scheduler, the gateway and each sampler
(for its decoders) hold one. It is maintained incrementally, a change at a time,
so reading it costs nothing however large the fleet, and nothing of it touches
PostgreSQL.

Liveness is judged on this process's monotonic clock, by when each heartbeat
arrived: no two hosts' clocks are compared, except once, for the values already
in the bucket when the watch starts (their age is the server's timestamp against
this host's clock, never less than zero). A view that has not watched for a
while (just started, or NATS was away) says so (``settled_for``): whoever
declares workers dead must wait until it has.

A worker is known by its kind and id together, its kind the key's: the decoders
share one NATS user, which may write any ``decoder.*`` key, so what is written
under ``decoder.gpu-7`` is decoder gpu-7's or nothing, never sampler gpu-7's (a
heartbeat of another kind than its key's is refused, and a deletion drops only
its key's worker)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import nats
import nats.errors
from nats.js.kv import KeyValue

from services.backoff import Backoff
from services.bus.connection import BUS_ERRORS
from services.bus.presence_board import CANARY, PLAN, Announcement, PresenceBoard, decode_plan
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import WarmPlan, WorkerRecord
from services.errors import BusError

log = logging.getLogger(__name__)

# How often the follow loop looks at its connection while nothing arrives.
POLL_S = 0.5


@dataclass(frozen=True)
class Seen:
    announcement: Announcement
    at: float  # when it arrived, on the view's clock
    # The worker as a record (live; its plan merged in), made once as it arrives:
    # a pass over a thousand workers reads records, it does not build them.
    record: WorkerRecord


def record_of(announcement: Announcement, plan: WarmPlan | None, *, live: bool, heard_at: datetime) -> WorkerRecord:
    hb = announcement.heartbeat
    return WorkerRecord(
        id=hb.id,
        kind=hb.kind,
        address=hb.address,
        device=hb.device,
        status=hb.status,
        models=hb.models,
        warm_models=hb.warm_models,
        vram_total_bytes=hb.vram_total_bytes,
        vram_used_bytes=hb.vram_used_bytes,
        temperature_c=hb.temperature_c,
        speed=hb.speed,
        completed=0,
        errors=0,
        busy_seconds=0.0,
        telemetry=dict(hb.telemetry),
        started_at=datetime.fromtimestamp(announcement.started_at, UTC),
        last_heartbeat=heard_at,
        planned_models=plan.models if plan is not None else (),
        primary_model=plan.primary if plan is not None else None,
        restarts=hb.restarts,
        capabilities=hb.capabilities,
        live=live,
    )


class PresenceView:
    """What the heartbeats of ``kinds`` say, folded in as they arrive."""

    def __init__(
        self,
        kinds: Collection[WorkerKind],
        *,
        clock: Callable[[], float] = time.monotonic,
        expect_within_s: float | None = None,
    ) -> None:
        self.kinds = frozenset(kinds)
        self.clock = clock
        # Something (a scheduler's own beat, ``CANARY``) arrives at least this often:
        # a watch silent for longer has stopped, and the view is unsettled until a
        # new one catches up. None: nothing is expected (a quiet bucket is quiet).
        self.expect_within_s = expect_within_s
        self._seen: dict[tuple[WorkerKind, str], Seen] = {}
        self._plans: dict[str, WarmPlan] = {}  # by sampler id: only samplers have plans
        self._settled_since: float | None = None

    # -- folding in -----------------------------------------------------------------

    def fold(self, key: str, value: bytes | None, *, age_s: float = 0.0) -> None:
        """One entry of the bucket: a heartbeat, a plan, or a deletion (value None).
        ``age_s``: how long ago it was written, for values that predate the watch."""
        prefix, _, worker_id = key.partition(".")
        if prefix == CANARY:
            return
        if prefix == PLAN:
            self._fold_plan(key, worker_id, value)
            return
        kind = next((k for k in self.kinds if k.value == prefix), None)
        if kind is None:
            return
        if value is None:
            self._seen.pop((kind, worker_id), None)
            return
        try:
            announcement = Announcement.decode(value)
        except ValueError as exc:
            log.warning("presence: %s under %s", exc, key)
            return
        hb = announcement.heartbeat
        if (hb.kind, hb.id) != (kind, worker_id):
            log.warning("presence: a heartbeat of %s %s under %s, refused", hb.kind.value, hb.id, key)
            return
        self._remember(kind, worker_id, announcement, self.clock() - max(0.0, age_s))

    def _fold_plan(self, key: str, worker_id: str, value: bytes | None) -> None:
        if value is None:
            self._plans.pop(worker_id, None)
        else:
            try:
                self._plans[worker_id] = decode_plan(value)
            except ValueError as exc:
                log.warning("presence: %s under %s", exc, key)
                return
        seen = self._seen.get((WorkerKind.SAMPLER, worker_id))
        if seen is not None:
            self._remember(WorkerKind.SAMPLER, worker_id, seen.announcement, seen.at)

    def _remember(self, kind: WorkerKind, worker_id: str, announcement: Announcement, at: float) -> None:
        heard = datetime.fromtimestamp(time.time() - (self.clock() - at), UTC)
        plan = self._plans.get(worker_id) if kind == WorkerKind.SAMPLER else None
        record = record_of(announcement, plan, live=True, heard_at=heard)
        self._seen[(kind, worker_id)] = Seen(announcement, at, record)

    @property
    def keys(self) -> str:
        """What of the bucket the view needs: a sampler's view of its decoders
        watches the decoders' keys alone (not every sampler's heartbeat, which a
        thousand samplers would each receive a thousand times a second)."""
        if len(self.kinds) == 1:
            [kind] = self.kinds
            return f"{kind.value}.>"
        return ">"

    def settled(self) -> None:
        """The watch has delivered what the bucket held, and follows it."""
        if self._settled_since is None:
            self._settled_since = self.clock()

    def unsettled(self) -> None:
        """The watch may have missed heartbeats (NATS away): ages mean nothing for now."""
        self._settled_since = None

    def settled_for(self, seconds: float) -> bool:
        since = self._settled_since
        return since is not None and self.clock() - since >= seconds

    # -- reading ----------------------------------------------------------------------

    def age_s(self, kind: WorkerKind, worker_id: str) -> float | None:
        """Seconds since the worker's last heartbeat arrived; None: never heard of."""
        seen = self._seen.get((kind, worker_id))
        return None if seen is None else self.clock() - seen.at

    def ages(self, kind: WorkerKind) -> dict[str, float]:
        """Every worker of ``kind`` the view knows, by id, with the seconds since its
        last heartbeat arrived."""
        now = self.clock()
        return {wid: now - s.at for (k, wid), s in self._seen.items() if k == kind}

    def fresh(self, kind: WorkerKind, *, stale_after_s: float) -> dict[str, float]:
        """Every worker of ``kind`` heard from within ``stale_after_s``, by id, with its age."""
        return {wid: age for wid, age in self.ages(kind).items() if age <= stale_after_s}

    def all(self, kind: WorkerKind, *, stale_after_s: float) -> list[WorkerRecord]:
        """Every worker of ``kind`` the bucket knows, by id, each marked live or not."""
        now = self.clock()
        out = []
        for wid in sorted(wid for k, wid in self._seen if k == kind):
            seen = self._seen[(kind, wid)]
            out.append(seen.record if now - seen.at <= stale_after_s else replace(seen.record, live=False))
        return out

    def live(self, kind: WorkerKind, *, stale_after_s: float) -> list[WorkerRecord]:
        """Workers of ``kind`` that take work: ready, with a recent heartbeat."""
        return [w for w in self.all(kind, stale_after_s=stale_after_s) if w.live and w.status == WorkerStatus.READY]

    def get(self, kind: WorkerKind, worker_id: str) -> WorkerRecord | None:
        """The worker as last heard (marked live whatever its age); None: never heard of."""
        seen = self._seen.get((kind, worker_id))
        return None if seen is None else seen.record

    def plan(self, worker_id: str) -> WarmPlan | None:
        return self._plans.get(worker_id)


async def follow(
    view: PresenceView, nc: nats.NATS, open_board: Callable[[], Awaitable[PresenceBoard]], stop: asyncio.Event
) -> None:
    """Folds the bucket's changes into ``view`` until ``stop``. Rides out NATS going
    away: the view is unsettled meanwhile, and the watch starts over from the
    bucket's latest values once NATS is back."""
    backoff = Backoff(max_s=2.0)
    while not stop.is_set():
        try:
            watcher = await (await open_board()).watch(view.keys)
            try:
                await _fold(view, nc, watcher, stop)
                backoff.reset()
            finally:
                with contextlib.suppress(BusError, *BUS_ERRORS):
                    await watcher.stop()
        except (BusError, *BUS_ERRORS) as exc:
            view.unsettled()
            log.warning("presence: cannot watch the bucket, retrying in %.1fs: %s", backoff.next_s, exc)
            await backoff.wait(stop)


async def _fold(view: PresenceView, nc: nats.NATS, watcher: KeyValue.KeyWatcher, stop: asyncio.Event) -> None:
    """One watch, until ``stop``, or until NATS was away or the watch fell silent
    for longer than the view expects (then the caller starts over)."""
    initial = True
    heard_at = view.clock()
    while not stop.is_set():
        if not nc.is_connected:
            view.unsettled()
            while not nc.is_connected and not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), POLL_S)
            return
        if view.expect_within_s is not None and view.clock() - heard_at > view.expect_within_s:
            view.unsettled()
            log.warning("presence: nothing heard for %.1fs; watching afresh", view.clock() - heard_at)
            return
        try:
            entry = await watcher.updates(timeout=POLL_S)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        heard_at = view.clock()
        if entry is None:  # the bucket's latest values are all in
            initial = False
            view.settled()
            continue
        value = None if entry.operation in ("DEL", "PURGE") else entry.value
        view.fold(entry.key, value, age_s=entry_age_s(entry.created) if initial else 0.0)


def entry_age_s(created: object) -> float:
    """How long ago the server stored an entry (its timestamp against this host's clock)."""
    if isinstance(created, datetime):
        return max(0.0, time.time() - created.timestamp())
    if isinstance(created, int | float):
        return max(0.0, time.time() - float(created) / 1e9)
    return 0.0
