"""Presence on NATS: a JetStream key-value bucket where each worker keeps its latest
heartbeat under its own key (``sampler.ID``, ``decoder.ID``), and the scheduler
keeps each sampler's warm plan (``plan.ID``). PostgreSQL keeps only what must be
durable: a worker's registration (its incarnation, which fences the jobs it held)
and its stop. A heartbeat is one NATS publish, never a database write, however
many GPUs there are.

A worker writes its key with compare-and-set on the revision it wrote last: a
newer process of the same worker id (it registered in PostgreSQL, then wrote the
key) makes the next write fail, and the older one learns it was superseded."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import nats
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from services import reported
from services.backoff import Backoff
from services.bus.connection import BUS_ERRORS
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import WarmPlan, WorkerHeartbeat
from services.errors import BusError, WorkerSuperseded

log = logging.getLogger(__name__)

BUCKET = "DARKROOM_PRESENCE"
STREAM = f"KV_{BUCKET}"
SUBJECT_PREFIX = f"$KV.{BUCKET}"
# A key not written for this long leaves the bucket: longer than a worker is kept
# in the registry (``worker_forget_after_s``'s default is an hour), so the
# scheduler can still tell when a silent worker was last heard of.
KEEP_S = 6 * 3600.0
PLAN = "plan"
# JetStream's "stream name already in use with a different configuration".
_STREAM_NAME_IN_USE = 10058


def worker_key(kind: WorkerKind, worker_id: str) -> str:
    return f"{kind.value}.{worker_id}"


def plan_key(worker_id: str) -> str:
    return f"{PLAN}.{worker_id}"


# A scheduler replica's own beat in the bucket: its view of the bucket expects to
# see it, so a watch that stopped delivering (its NATS server cut off, not yet
# noticed) is told apart from a quiet fleet.
CANARY = "scheduler"


def canary_key(replica: str) -> str:
    return f"{CANARY}.{replica}"


@dataclass(frozen=True)
class Announcement:
    """What one heartbeat puts under the worker's key."""

    heartbeat: WorkerHeartbeat
    incarnation: str
    started_at: float  # when this incarnation registered, seconds since the epoch (its host's clock)

    def encode(self) -> bytes:
        hb = asdict(self.heartbeat)
        hb["kind"] = self.heartbeat.kind.value
        hb["status"] = self.heartbeat.status.value
        return json.dumps({"heartbeat": hb, "incarnation": self.incarnation, "started_at": self.started_at}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Announcement:
        """Raises ValueError on anything malformed: every field of the type and range
        a worker sends (``services.reported``), since whoever reads it (the
        scheduler, a gateway, every sampler) turns them into records, numbers and
        protobuf messages, and a key's writer may be anyone holding its NATS user."""
        try:
            body = json.loads(data)
            hb = body["heartbeat"]
            if not isinstance(hb, dict) or not isinstance(hb.get("telemetry", {}), dict):
                raise ValueError("its heartbeat and telemetry must be objects")
            unknown = set(hb) - _HEARTBEAT_FIELDS
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            for name in ("id", "address", "device"):
                if not isinstance(hb.get(name), str):
                    raise ValueError(f"{name} must be a string")
            for name in ("models", "warm_models", "capabilities"):
                if not isinstance(hb.get(name, []), list) or len(reported.texts(hb, name)) != len(hb.get(name, [])):
                    raise ValueError(f"{name} must be a list of strings")
            started_at = reported.number(body, "started_at", math.nan)
            if not 0 <= started_at <= _LATEST_START:
                raise ValueError(f"started_at {body.get('started_at')!r} is no time a worker started at")
            heartbeat = WorkerHeartbeat(
                id=hb["id"],
                kind=WorkerKind(hb["kind"]),
                address=hb["address"],
                device=hb["device"],
                models=reported.texts(hb, "models"),
                warm_models=reported.texts(hb, "warm_models"),
                vram_total_bytes=_count(hb, "vram_total_bytes"),
                vram_used_bytes=_count(hb, "vram_used_bytes"),
                temperature_c=_number(hb, "temperature_c", 0.0),
                speed=_number(hb, "speed", 1.0, above=0.0),
                status=WorkerStatus(hb["status"]),
                restarts=_count(hb, "restarts", most=reported.UINT32),
                telemetry=dict(hb.get("telemetry", {})),
                capabilities=reported.texts(hb, "capabilities"),
            )
            return cls(heartbeat, str(body["incarnation"]), started_at)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise ValueError(f"malformed announcement: {exc}") from exc


_HEARTBEAT_FIELDS = {f.name for f in fields(WorkerHeartbeat)}
# Seconds since the epoch past which no worker started (the year 5138).
_LATEST_START = 1e11


def _count(hb: dict[str, Any], name: str, *, most: int = reported.UINT64) -> int:
    value = reported.count(hb, name, -1, most=most) if name in hb else 0
    if value < 0:
        raise ValueError(f"{name} {hb[name]!r} is not a whole number at least 0")
    return value


def _number(hb: dict[str, Any], name: str, default: float, *, above: float = -math.inf) -> float:
    value = reported.number(hb, name, math.nan) if name in hb else default
    if not value > above:  # NaN too
        raise ValueError(f"{name} {hb[name]!r} is not a finite number above {above}")
    return value


def encode_plan(plan: WarmPlan) -> bytes:
    return json.dumps({"primary": plan.primary, "models": list(plan.models)}).encode()


def decode_plan(data: bytes) -> WarmPlan:
    try:
        body = json.loads(data)
        primary = body.get("primary")
        return WarmPlan(str(primary) if primary is not None else None, tuple(str(m) for m in body.get("models", ())))
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed warm plan: {exc}") from exc


def bucket_config(replicas: int) -> KeyValueConfig:
    # History 1: only the latest heartbeat matters; file storage: a restarted
    # nats-server still knows the plans and when each worker was last heard of.
    return KeyValueConfig(bucket=BUCKET, history=1, ttl=KEEP_S, storage=StorageType.FILE, replicas=max(1, replicas))


class PresenceBoard:
    """The bucket, opened: a worker's announcements and reads of its plan; the
    scheduler's plans; anyone's watch."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self._revisions: dict[str, tuple[str, int]] = {}  # key -> (incarnation, revision) written last

    @classmethod
    async def open(
        cls, js: JetStreamContext, *, replicas: int = 1, create: bool = True, patience_s: float = 0.0
    ) -> PresenceBoard:
        """The bucket, created where ``create`` (the scheduler; any service of an
        open mesh) or else waited for up to ``patience_s``. Raises BusError."""
        backoff = Backoff(max_s=2.0)
        deadline = time.monotonic() + patience_s
        while True:
            try:
                if create:
                    try:
                        return cls(await js.create_key_value(bucket_config(replicas)))
                    except BadRequestError as exc:
                        if exc.err_code != _STREAM_NAME_IN_USE:
                            raise
                        # Made already, with other settings (another service's
                        # replicas): it is the same bucket; use it as it is.
                return cls(await js.key_value(BUCKET))
            except (BucketNotFoundError, NotFoundError) as exc:
                if time.monotonic() >= deadline:
                    raise BusError(f"the presence bucket {BUCKET} does not exist yet") from exc
                await backoff.wait()
            except BUS_ERRORS as exc:
                raise BusError(f"cannot open the presence bucket: {exc}") from exc

    async def announce(self, announcement: Announcement) -> None:
        """Writes the worker's heartbeat. Raises WorkerSuperseded if a newer
        incarnation of it wrote meanwhile, BusError if NATS cannot take it."""
        hb = announcement.heartbeat
        key = worker_key(hb.kind, hb.id)
        data = announcement.encode()
        mine = self._revisions.get(key)
        try:
            if mine is None or mine[0] != announcement.incarnation:
                revision = await self.kv.put(key, data)
            else:
                try:
                    revision = await self.kv.update(key, data, last=mine[1])
                except KeyWrongLastSequenceError:
                    revision = await self._after_conflict(key, data, announcement.incarnation)
        except BUS_ERRORS as exc:
            raise BusError(f"heartbeat not published: {exc}") from exc
        self._revisions[key] = (announcement.incarnation, revision)

    async def _after_conflict(self, key: str, data: bytes, incarnation: str) -> int:
        """Someone else wrote the key since this worker did: a newer incarnation
        (superseded), or this one's own write whose answer was lost."""
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return await self.kv.put(key, data)  # aged out or purged: write afresh
        if entry.value is not None:
            try:
                holder = Announcement.decode(entry.value).incarnation
            except ValueError:
                holder = ""
            if holder != incarnation:
                raise WorkerSuperseded(f"worker {key} was taken over by incarnation {holder}")
        return await self.kv.put(key, data)

    async def plan(self, worker_id: str) -> WarmPlan | None:
        """The warm plan the scheduler stored for this sampler; None: none yet."""
        try:
            entry = await self.kv.get(plan_key(worker_id))
        except KeyNotFoundError:
            return None
        except BUS_ERRORS as exc:
            raise BusError(f"cannot read the warm plan: {exc}") from exc
        if entry.value is None:
            return None
        try:
            return decode_plan(entry.value)
        except ValueError as exc:
            log.warning("ignoring %s", exc)
            return None

    async def store_plan(self, worker_id: str, plan: WarmPlan) -> None:
        try:
            await self.kv.put(plan_key(worker_id), encode_plan(plan))
        except BUS_ERRORS as exc:
            raise BusError(f"cannot store the warm plan of {worker_id}: {exc}") from exc

    async def canary(self, replica: str) -> None:
        try:
            await self.kv.put(canary_key(replica), b"{}")
        except BUS_ERRORS as exc:
            raise BusError(f"cannot beat in the presence bucket: {exc}") from exc

    async def watch(self, keys: str = ">") -> KeyValue.KeyWatcher:
        """Every key's latest value, then each change as it is written."""
        try:
            return await self.kv.watch(keys, inactive_threshold=30.0)
        except BUS_ERRORS as exc:
            raise BusError(f"cannot watch presence: {exc}") from exc


class BoardOnConnection:
    """The board over a connection that a service's NATS part makes (``connection``
    returns it, None until it is made), opened at first use and kept."""

    def __init__(self, connection: Callable[[], nats.NATS | None], *, replicas: int = 1, create: bool = True) -> None:
        self.connection, self.replicas, self.create = connection, replicas, create
        self._board: PresenceBoard | None = None

    async def __call__(self) -> PresenceBoard:
        if self._board is None:
            nc = self.connection()
            if nc is None:
                raise BusError("not connected to NATS yet")
            self._board = await PresenceBoard.open(nc.jetstream(), replicas=self.replicas, create=self.create)
        return self._board
