"""Scheduler failover: when the replica holding the scheduler lock freezes (SIGSTOP)
or dies (SIGKILL) in the middle of a pass, another replica takes over within
seconds, and no job is ever dispatched twice.

Real processes, a real PostgreSQL and a real nats-server. The test watches
``pg_locks`` for the moment a scheduler holds the advisory lock, and freezes that
scheduler's OS process there, so the fault lands inside the lock-holding
transaction every time rather than by luck."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import psycopg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from services.bus.dispatch import DISPATCH_STREAM
from services.config.sections import KernelSettings
from services.db.repository import IDLE_IN_TRANSACTION_MS, SCHEDULER_LOCK
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.ops.supervisor import Child
from tests.conftest import make_stack
from tests.helpers import announce_fake_samplers, env_of, nats_as_operator, wait_for

pytestmark = pytest.mark.integration

WORKERS = ["fake-a", "fake-b", "fake-c"]
SCHEDULER_APP = re.compile(r"darkroom-scheduler-(\d+)")
# pg_locks shows a bigint advisory key as classid (high 32 bits), objid (low 32
# bits) and objsubid = 1 (objsubid = 2 is the two-int4 form).
LOCK_CLASSID, LOCK_OBJID = SCHEDULER_LOCK >> 32, SCHEDULER_LOCK & 0xFFFFFFFF
HOLDER_SQL = (
    "SELECT l.pid, a.application_name, a.state, a.backend_xid IS NOT NULL"
    " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s AND l.objsubid = 1"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
# How long a frozen process must be seen holding the lock, idle in its transaction,
# before the test believes the freeze landed inside a pass (and not on a COMMIT
# already on its way to the server).
CONFIRM_S = 0.3


@dataclass(frozen=True)
class FrozenScheduler:
    """A scheduler process stopped while holding the lock, and its server backend."""

    proc: Child
    os_pid: int
    backend_pid: int
    stopped_at: float


@dataclass
class Audit:
    """Every message on the dispatch stream, read by a durable consumer of its own
    (the fake workers have no processes, so nothing else consumes the stream)."""

    kernel: KernelSettings
    messages: list[tuple[str, dict]] = field(default_factory=list)

    def read(self) -> set[str]:
        self.messages += asyncio.run(self._fetch())
        return {body["job_id"] for _, body in self.messages}

    async def _fetch(self) -> list[tuple[str, dict]]:
        nc = await nats_as_operator(self.kernel)
        try:
            sub = await nc.jetstream().pull_subscribe(
                "darkroom.dispatch.>",
                durable="audit",
                stream=DISPATCH_STREAM,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
            )
            out: list[tuple[str, dict]] = []
            while True:
                try:
                    msgs = await sub.fetch(200, timeout=0.3)
                except (TimeoutError, nats.errors.TimeoutError):
                    return out
                for m in msgs:
                    out.append((m.subject, json.loads(m.data)))
                    await m.ack()
        finally:
            await nc.close()


def pg_url(stack: LocalStack) -> str:
    return stack.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")


def seed_workers(conn: psycopg.Connection, kernel: KernelSettings) -> None:
    """Fake samplers: registered in PostgreSQL, and heard of once on NATS (stale only
    after an hour here), as a real one would be."""
    for w in WORKERS:
        conn.execute(
            "INSERT INTO workers (id, kind, address, device, status, models, warm_models, telemetry, started_at,"
            " last_heartbeat) VALUES (%s, 'sampler', '127.0.0.1:1', 'fake', 'ready', %s, %s, '{}', now(), now())",
            (w, json.dumps(["tiny"]), json.dumps(["tiny"] if w != "fake-c" else [])),
        )

    announce_fake_samplers(kernel, {w: ("tiny",) if w != "fake-c" else () for w in WORKERS})


def insert_jobs(conn: psycopg.Connection, n: int) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in range(n)]
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO jobs (id, status, lane, priority, model, prompt, negative_prompt, width, height, steps,"
            " guidance_scale, seed, num_images, created_at) VALUES (%s, 'QUEUED', 'free', 0, 'tiny', 'p', '',"
            " 64, 64, 2, 7.5, 1, 1, now())",
            [(i,) for i in ids],
        )
    return ids


def statuses(conn: psycopg.Connection, ids: list[str]) -> collections.Counter[str]:
    rows = conn.execute("SELECT status FROM jobs WHERE id = ANY(%s)", (ids,)).fetchall()
    return collections.Counter(r[0] for r in rows)


def queued(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'QUEUED'").fetchone()
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class LockHolder:
    backend_pid: int
    application_name: str
    state: str
    # The transaction has written (a transaction id is assigned on its first write):
    # the pass has already marked jobs SCHEDULED, uncommitted.
    wrote: bool


def lock_holders(conn: psycopg.Connection) -> list[LockHolder]:
    return [LockHolder(*row) for row in conn.execute(HOLDER_SQL, (LOCK_CLASSID, LOCK_OBJID))]


def backend_alive(conn: psycopg.Connection, backend_pid: int) -> bool:
    return conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (backend_pid,)).fetchone() is not None


def is_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (Linux /proc)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue
        states.append(stat.rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in ("T", "t") for s in states)


def new_stack(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> LocalStack:
    stack = make_stack(tmp_path, postgres, models_dir)
    stack.start_backends()
    stack.settings = stack.settings.with_env(
        env_of(
            # Fake workers never take jobs off their backlog: let them hold any number.
            worker_backlog=100_000,
            scheduler_batch=16,
            worker_stale_after_s=3600,
            # Jobs seeded into the table send no work event: looked for every 10 ms.
            scheduler_interval_s=0.01,
            scheduler_idle_interval_max_s=0.01,
            # Nothing here starts a job, so redispatch would publish every SCHEDULED job
            # again: keep it out, so the audit counts placements only.
            redispatch_after_s=3600,
            log_level="DEBUG",
        )
    )
    return stack


@contextmanager
def frozen_processes() -> Iterator[set[int]]:
    """Pids the test has SIGSTOPped; each is SIGCONTinued on the way out, so that
    the stack can stop it."""
    stopped: set[int] = set()
    try:
        yield stopped
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def freeze_lock_holder(
    mon: psycopg.Connection,
    schedulers: list[Child],
    stopped: set[int],
    refill: Callable[[], None],
    *,
    attempts: int = 20,
) -> FrozenScheduler:
    """SIGSTOPs a scheduler while it holds the scheduler lock, and returns it once
    its backend has been seen holding the lock, idle in its transaction, for
    CONFIRM_S after the process stopped: the freeze is inside a pass. The pass
    has already marked jobs SCHEDULED, uncommitted: the place where a pass that
    could still commit after the takeover would dispatch jobs twice."""
    by_pid = {p.proc.pid: p for p in schedulers if p.proc is not None}
    for _ in range(attempts):
        refill()
        deadline = time.monotonic() + 10
        while True:
            for p in schedulers:
                assert p.running, f"{p.name} exited:\n{p.log_tail()}"
            seen = lock_holders(mon)
            match = [(h, SCHEDULER_APP.fullmatch(h.application_name)) for h in seen if h.wrote]
            hits = [(h.backend_pid, int(m.group(1))) for h, m in match if m is not None]
            if hits:
                break
            assert time.monotonic() < deadline, f"no scheduler seen holding the lock; holders: {seen}"
        backend_pid, os_pid = hits[0]
        assert os_pid in by_pid, f"lock held by {os_pid}, which is none of the schedulers {sorted(by_pid)}"
        os.kill(os_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        stopped.add(os_pid)
        wait_for(functools.partial(is_stopped, os_pid), bool, timeout=5, what=f"scheduler {os_pid} to stop")
        confirm_until = time.monotonic() + CONFIRM_S
        held = True
        while held and time.monotonic() < confirm_until:
            held = [h.backend_pid for h in lock_holders(mon)] == [backend_pid]
        now = [(h.state, h.wrote) for h in lock_holders(mon) if h.backend_pid == backend_pid]
        if held and now == [("idle in transaction", True)]:
            return FrozenScheduler(by_pid[os_pid], os_pid, backend_pid, stopped_at)
        # The pass ended before the stop took hold: let it go and try again.
        os.kill(os_pid, signal.SIGCONT)
        stopped.discard(os_pid)
    raise AssertionError(f"never froze a scheduler inside a pass in {attempts} attempts")


def assert_dispatched_once(conn: psycopg.Connection, audit: Audit) -> int:
    """Every job is SCHEDULED on attempt 1 and on the stream exactly once, on its
    worker's subject; returns how many jobs there are."""
    jobs: dict[str, tuple[str, str | None, int]] = {
        i: (s, w, a) for i, s, w, a in conn.execute("SELECT id, status, worker_id, attempt FROM jobs").fetchall()
    }
    # Published just after their commit: wait for the last ones to land.
    wait_for(audit.read, lambda ids: set(jobs) <= ids, timeout=15, what="every job to be dispatched")
    assert {s for s, _, _ in jobs.values()} == {"SCHEDULED"}, collections.Counter(s for s, _, _ in jobs.values())
    assert {a for _, _, a in jobs.values()} == {1}
    per_job = collections.Counter(body["job_id"] for _, body in audit.messages)
    twice = [j for j, n in per_job.items() if n > 1]
    assert not twice, f"{len(twice)} jobs dispatched more than once, e.g. {twice[:5]}"
    assert set(per_job) == set(jobs), f"{len(set(jobs) - set(per_job))} jobs never dispatched"
    for subject, body in audit.messages:
        assert subject == f"darkroom.dispatch.{jobs[body['job_id']][1]}"
        assert body["attempt"] == 1
    return len(jobs)


def test_frozen_replica_lock_is_released_and_other_replica_takes_over(tmp_path, postgres, models_dir) -> None:
    stack = new_stack(tmp_path, postgres, models_dir)
    audit = Audit(stack.settings.kernel)
    try:
        with psycopg.connect(pg_url(stack), autocommit=True) as db, frozen_processes() as stopped:
            seed_workers(db, stack.settings.kernel)
            insert_jobs(db, 200)
            a = stack.add("scheduler-a", "scheduler")
            b = stack.add("scheduler-b", "scheduler")
            schedulers = [a, b]

            def refill() -> None:
                if queued(db) < 100:
                    insert_jobs(db, 300)

            frozen = freeze_lock_holder(db, schedulers, stopped, refill)
            other = b if frozen.proc is a else a

            # Jobs that arrive while the frozen replica holds the lock.
            fresh = insert_jobs(db, 50)
            # Mutual exclusion: while the frozen backend still holds the lock, the
            # other replica cannot have placed any of them.
            before = statuses(db, fresh)
            if [h.backend_pid for h in lock_holders(db)] == [frozen.backend_pid]:
                assert before == {"QUEUED": len(fresh)}, before

            # The server ends the frozen transaction (idle_in_transaction_session_timeout),
            # and with it the lock; nothing else can, the process being stopped.
            wait_for(
                lambda: backend_alive(db, frozen.backend_pid),
                lambda alive: not alive,
                timeout=IDLE_IN_TRANSACTION_MS / 1000 + 5,
                what="the server to end the frozen scheduler's session",
            )
            released_after = time.monotonic() - frozen.stopped_at
            assert frozen.backend_pid not in [h.backend_pid for h in lock_holders(db)]

            # The other replica places every job, the new ones included, while the
            # first is still frozen, and publishes each.
            wait_for(lambda: queued(db), lambda n: n == 0, timeout=15, what="the other replica to empty the queue")
            assert statuses(db, fresh) == {"SCHEDULED": len(fresh)}
            wait_for(audit.read, lambda ids: set(fresh) <= ids, timeout=15, what="the new jobs to be dispatched")
            taken_over_after = time.monotonic() - frozen.stopped_at
            assert is_stopped(frozen.os_pid), "the frozen scheduler ran during the takeover"
            assert other.running, other.log_tail()

            # Let the frozen replica go: its pass was rolled back by the server, so it
            # must not commit or publish it now, and it carries on scheduling.
            log_mark = len(frozen.proc.log_tail(10**8))
            os.kill(frozen.os_pid, signal.SIGCONT)
            stopped.discard(frozen.os_pid)
            later = insert_jobs(db, 400)
            wait_for(lambda: queued(db), lambda n: n == 0, timeout=30, what="the queue to empty after the resume")
            wait_for(audit.read, lambda ids: set(later) <= ids, timeout=15, what="the later jobs to be dispatched")
            resumed_log = frozen.proc.log_tail(10**8)[log_mark:]
            assert frozen.proc.running, frozen.proc.log_tail()
            assert other.running, other.log_tail()
            # Its interrupted pass fails (the server's FATAL idle-in-transaction message,
            # or just the closed connection, depending on which the client reads first).
            assert "scheduling pass failed" in resumed_log, resumed_log[-3000:]
            assert "placed" in resumed_log, "the resumed scheduler never placed a job again"

            total = assert_dispatched_once(db, audit)
            print(
                f"frozen {frozen.proc.name}: session ended {released_after:.2f}s after the freeze, "
                f"{other.name} had every new job dispatched {taken_over_after:.2f}s after it; {total} jobs"
            )
            # The backend went idle an instant before the freeze: the idle timeout, and
            # nothing sooner, ended it.
            assert IDLE_IN_TRANSACTION_MS / 1000 - 1 < released_after < IDLE_IN_TRANSACTION_MS / 1000 + 3
    finally:
        stack.stop()


def test_killed_replica_other_takes_over(tmp_path, postgres, models_dir) -> None:
    stack = new_stack(tmp_path, postgres, models_dir)
    audit = Audit(stack.settings.kernel)
    url = pg_url(stack)
    feeding = threading.Event()
    feeder_errors: list[BaseException] = []

    def feed() -> None:
        # Jobs keep arriving, before, during and after the kill.
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                while feeding.is_set():
                    insert_jobs(conn, 5)
                    time.sleep(0.05)
        except BaseException as exc:
            feeder_errors.append(exc)

    feeder = threading.Thread(target=feed, daemon=True)
    try:
        with psycopg.connect(url, autocommit=True) as db, frozen_processes() as stopped:
            seed_workers(db, stack.settings.kernel)
            insert_jobs(db, 200)
            a = stack.add("scheduler-a", "scheduler")
            b = stack.add("scheduler-b", "scheduler")
            feeding.set()
            feeder.start()

            # Killed in the middle of a pass, lock held: pinned there with SIGSTOP
            # first, so that the kill always lands inside the transaction.
            victim = freeze_lock_holder(db, [a, b], stopped, lambda: None)
            survivor = b if victim.proc is a else a
            victim.proc.kill()
            t_killed = time.monotonic()
            stopped.discard(victim.os_pid)

            # The lock goes with the dead process's socket, at once: well before the
            # idle-in-transaction timeout would have ended the session.
            wait_for(
                lambda: backend_alive(db, victim.backend_pid),
                lambda alive: not alive,
                timeout=5,
                what="the killed scheduler's session to end",
            )
            released_after = time.monotonic() - t_killed
            assert released_after < IDLE_IN_TRANSACTION_MS / 1000 / 2, released_after

            # The survivor keeps up with the arrivals.
            after_kill = insert_jobs(db, 50)
            wait_for(lambda: statuses(db, after_kill), lambda c: c == {"SCHEDULED": 50}, timeout=15, what="takeover")
            taken_over_after = time.monotonic() - t_killed
            feeding.clear()
            feeder.join(10)
            assert not feeder_errors, feeder_errors
            wait_for(lambda: queued(db), lambda n: n == 0, timeout=30, what="the survivor to empty the queue")
            wait_for(audit.read, lambda ids: set(after_kill) <= ids, timeout=15, what="dispatches")
            assert survivor.running, survivor.log_tail()
            assert not victim.proc.running
            total = assert_dispatched_once(db, audit)
            print(
                f"killed {victim.proc.name}: session gone {released_after:.2f}s after the kill, "
                f"{survivor.name} placed new jobs {taken_over_after:.2f}s after it; {total} jobs"
            )
    finally:
        feeding.clear()
        if feeder.is_alive():
            feeder.join(10)
        stack.stop()
