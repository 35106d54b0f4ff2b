"""The worker registry, the durable part: each worker registers once per start (an
incarnation, which fences the jobs an earlier one held) and deregisters when it
stops. A worker id is one worker's, whatever its kind: a sampler and a decoder
given the same id would answer for each other (the jobs held, the heartbeats), so
the second to register is refused. Heartbeats and liveness live on NATS (``services.bus.presence_board``);
``last_heartbeat`` here is when the worker last registered, or last heartbeat while
NATS could not take its heartbeats."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from services.db.records import AttemptFailure
from services.db.repository.database import Area, fetch_all, fetch_one
from services.db.repository.requeue import requeue
from services.db.states import HELD, STARTED, WorkerKind, WorkerStatus
from services.db.worker_records import WORKER_COLUMNS, Registration, WorkerHeartbeat, WorkerRecord
from services.errors import WorkerIdTaken, WorkerSuperseded

_HELD = [st.value for st in HELD]
# The worker registered, or heartbeat here, recently, by the database's clock.
FRESH = "last_heartbeat > now() - make_interval(secs => %(stale_after_s)s)"
_HEARTBEAT_COLUMNS = (
    "kind",
    "address",
    "device",
    "status",
    "models",
    "warm_models",
    "capabilities",
    "vram_total_bytes",
    "vram_used_bytes",
    "temperature_c",
    "speed",
    "restarts",
    "telemetry",
    "incarnation",
)
_SET_HEARTBEAT = ", ".join(f"{name} = %({name})s" for name in _HEARTBEAT_COLUMNS) + ", last_heartbeat = now()"
_INSERT = f"""
INSERT INTO workers (id, {", ".join(_HEARTBEAT_COLUMNS)}, started_at, last_heartbeat)
VALUES (%(id)s, {", ".join(f"%({name})s" for name in _HEARTBEAT_COLUMNS)}, now(), now())
"""


def _values(hb: WorkerHeartbeat, incarnation: str) -> dict[str, Any]:
    return {
        "id": hb.id,
        "kind": hb.kind.value,
        "address": hb.address,
        "device": hb.device,
        "status": hb.status.value,
        "models": Jsonb(list(hb.models)),
        "warm_models": Jsonb(list(hb.warm_models)),
        "capabilities": Jsonb(list(hb.capabilities)),
        "vram_total_bytes": hb.vram_total_bytes,
        "vram_used_bytes": hb.vram_used_bytes,
        "temperature_c": hb.temperature_c,
        "speed": hb.speed,
        "restarts": hb.restarts,
        "telemetry": Jsonb(hb.telemetry),
        "incarnation": incarnation,
    }


class Workers(Area):
    async def register(self, hb: WorkerHeartbeat, incarnation: str) -> Registration:
        """A worker process starts: records it under a new incarnation. The jobs an
        earlier incarnation of the same worker held go back to the queue at once
        (a started one with its attempt counted), rather than wait behind a
        heartbeat that looks fresh. Raises WorkerIdTaken if a worker of another
        kind holds the id."""
        async with self.db.tx() as conn:
            earlier = await fetch_one(conn, "SELECT incarnation, kind FROM workers WHERE id = %s FOR UPDATE", (hb.id,))
            if earlier is not None and earlier["kind"] != hb.kind.value:
                raise WorkerIdTaken(f"worker id {hb.id} is registered as a {earlier['kind']}, not a {hb.kind.value}")
            requeued: list[str] = []
            if earlier is not None and earlier["incarnation"] != incarnation:
                held = await _held(conn, hb.id)
                changed = await requeue(
                    conn,
                    [
                        (
                            job["id"],
                            job["attempt"],
                            AttemptFailure(job["attempt"], hb.id, "the worker restarted")
                            if job["status"] in STARTED
                            else None,
                        )
                        for job in held
                    ],
                    now=await _db_now(conn),
                )
                requeued = sorted(changed)
            row = await fetch_one(
                conn,
                _INSERT + f" ON CONFLICT (id) DO UPDATE SET {_SET_HEARTBEAT}, started_at = now() RETURNING id",
                _values(hb, incarnation),
            )
            assert row is not None
            return Registration(tuple(requeued))

    async def heartbeat(self, worker_id: str, incarnation: str) -> None:
        """A heartbeat written to PostgreSQL: only while NATS cannot take the worker's
        heartbeats (its server cut off, a failover), so that the scheduler does not
        take a worker for dead because its NATS is away. Raises WorkerSuperseded if
        a newer process took this worker's id."""
        async with self.db.connection() as conn:
            mine = await fetch_one(
                conn,
                "UPDATE workers SET last_heartbeat = now() WHERE id = %s AND incarnation = %s RETURNING id",
                (worker_id, incarnation),
            )
            if mine is None:
                holder = await fetch_one(conn, "SELECT incarnation FROM workers WHERE id = %s", (worker_id,))
                if holder is not None:
                    raise WorkerSuperseded(f"worker {worker_id} was taken over by incarnation {holder['incarnation']}")

    async def deregister(self, worker_id: str, incarnation: str) -> list[str]:
        """The worker stops: marked gone, and whatever it still holds goes back to
        the queue without counting an attempt (it stopped in order). Returns those jobs."""
        async with self.db.tx() as conn:
            mine = await fetch_one(
                conn,
                "UPDATE workers SET status = %s WHERE id = %s AND incarnation = %s RETURNING id",
                (WorkerStatus.GONE.value, worker_id, incarnation),
            )
            if mine is None:
                return []
            held = await _held(conn, worker_id)
            changed = await requeue(conn, [(j["id"], j["attempt"], None) for j in held], now=await _db_now(conn))
            return sorted(changed)

    async def all(self, kind: WorkerKind, *, stale_after_s: float) -> list[WorkerRecord]:
        rows = await self.db.all(
            f"SELECT {WORKER_COLUMNS}, {FRESH} AS fresh FROM workers WHERE kind = %(kind)s ORDER BY id",
            {"kind": kind.value, "stale_after_s": stale_after_s},
        )
        return [WorkerRecord.of(row, live=bool(row["fresh"])) for row in rows]

    async def get(self, worker_id: str) -> WorkerRecord | None:
        row = await self.db.one(f"SELECT {WORKER_COLUMNS} FROM workers WHERE id = %s", (worker_id,))
        return WorkerRecord.of(row) if row is not None else None

    async def forgettable(self, kind: WorkerKind, *, gone_for_s: float, heard_from: Collection[str]) -> list[str]:
        """Workers of ``kind`` registered longer ago than ``gone_for_s``, not among
        those of that kind ``heard_from`` since (presence says who), holding no job:
        gone for good."""
        rows = await self.db.all(
            f"""
            SELECT id FROM workers w
            WHERE kind = %(kind)s AND NOT ({FRESH}) AND id <> ALL(%(heard)s)
              AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.worker_id = w.id AND jobs.status = ANY(%(held)s))
            ORDER BY id
            """,
            {"kind": kind.value, "stale_after_s": gone_for_s, "held": _HELD, "heard": sorted(heard_from)},
        )
        return [row["id"] for row in rows]

    async def forget(self, worker_id: str, *, gone_for_s: float) -> bool:
        """Deletes the worker's row, unless it registered again meanwhile."""
        changed = await self.db.run(
            f"DELETE FROM workers WHERE id = %(id)s AND NOT ({FRESH})", {"id": worker_id, "stale_after_s": gone_for_s}
        )
        return changed > 0


async def _held(conn: AsyncConnection[DictRow], worker_id: str) -> list[DictRow]:
    return await fetch_all(
        conn,
        "SELECT id, attempt, status FROM jobs WHERE worker_id = %s AND status = ANY(%s) ORDER BY id FOR UPDATE",
        (worker_id, _HELD),
    )


async def _db_now(conn: AsyncConnection[DictRow]) -> Any:
    row = await fetch_one(conn, "SELECT now() AS now")
    assert row is not None
    return row["now"]
