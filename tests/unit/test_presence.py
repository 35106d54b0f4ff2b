"""Worker presence (services/presence.py) over a fake registry and a fake bucket: it
registers once the database is back and publishes the jobs an earlier run held,
heartbeats on its interval with the status it is in (never through the registry),
follows the warm plan stored for it, says a change of status at once, stops when a
newer process took its id, deregisters publishing the jobs it handed back, and
stops as misconfigured when a worker of the other kind holds its id."""

from __future__ import annotations

import asyncio

import pytest

from services.config.fields import SettingsError
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import Registration, WarmPlan, WorkerHeartbeat
from services.errors import BusError, WorkerIdTaken, WorkerSuperseded
from services.presence import Presence
from tests.fakes import FakeBoard, FakeWorkers, RecordedEvents


def heartbeat(status: WorkerStatus) -> WorkerHeartbeat:
    return WorkerHeartbeat("w1", WorkerKind.DECODER, "127.0.0.1:1", "cpu", ("tiny",), (), status=status)


class Harness:
    def __init__(self, interval_s: float = 60.0) -> None:
        self.workers = FakeWorkers()
        self.board = FakeBoard()
        self.events = RecordedEvents()
        self.superseded_calls = 0
        self.presence = Presence(
            self.workers,
            self.board.opened,
            "w1",
            heartbeat,
            self.events,
            interval_s=interval_s,
            on_superseded=self._superseded,
            reads_plan=True,
        )

    def _superseded(self) -> None:
        self.superseded_calls += 1

    def statuses(self) -> list[WorkerStatus]:
        return [a.heartbeat.status for a in self.board.beats]


async def test_it_registers_once_the_database_is_back_and_publishes_the_requeued_jobs() -> None:
    h = Harness()
    h.workers.register_outage.calls = 2
    h.workers.requeued = ("j1", "j2")
    h.board.stored_plan = WarmPlan("tiny", ("tiny",))
    assert await asyncio.wait_for(h.presence.register(asyncio.Event()), 10.0)
    assert h.workers.register_outage.tried == 3
    [(hb, incarnation)] = h.workers.registered
    assert hb.status == WorkerStatus.STARTING and incarnation == h.presence.incarnation
    assert h.statuses() == [WorkerStatus.STARTING]  # heard of at once, on NATS
    assert h.presence.plan == WarmPlan("tiny", ("tiny",))  # read back with that heartbeat
    assert [(e.job_id, e.attempt, e.status) for e in h.events.published] == [("j1", 0, None), ("j2", 0, None)]
    assert h.events.work_calls == 1


async def test_registering_gives_up_when_stopped() -> None:
    h = Harness()
    h.workers.register_outage.calls = -1
    stop = asyncio.Event()
    registering = asyncio.create_task(h.presence.register(stop))
    stop.set()
    assert await asyncio.wait_for(registering, 5.0) is False
    assert h.workers.registered == []


async def test_each_start_is_a_new_incarnation() -> None:
    assert Harness().presence.incarnation != Harness().presence.incarnation


async def test_it_heartbeats_on_its_interval_until_told_to_stop() -> None:
    h = Harness(interval_s=0.01)
    h.board.stored_plan = WarmPlan(None, ("tiny",))
    until = asyncio.Event()
    running = asyncio.create_task(h.presence.run(until))
    for _ in range(3):
        await asyncio.wait_for(h.board.beaten.wait(), 5.0)
        h.board.beaten.clear()
    until.set()
    await asyncio.wait_for(running, 5.0)
    assert len(h.board.beats) >= 3
    assert {a.incarnation for a in h.board.beats} == {h.presence.incarnation}
    assert h.presence.plan == WarmPlan(None, ("tiny",))
    assert h.workers.registered == []  # a heartbeat is never a database write


async def test_a_status_change_is_said_at_once() -> None:
    h = Harness()
    await h.presence.set_status(WorkerStatus.READY)
    await h.presence.set_status(WorkerStatus.READY)  # no change: nothing to say
    await h.presence.set_status(WorkerStatus.DRAINING)
    assert h.statuses() == [WorkerStatus.READY, WorkerStatus.DRAINING]


async def test_a_heartbeat_that_fails_is_tried_again_at_the_next_one() -> None:
    h = Harness()
    h.board.errors.append(BusError("NATS is away"))
    await h.presence.beat()
    # Meanwhile the database was told, so that the worker is not taken for dead.
    assert h.workers.beats_here == [("w1", h.presence.incarnation)]
    await h.presence.beat()
    assert len(h.board.beats) == 2 and not h.presence.superseded.is_set()
    assert len(h.workers.beats_here) == 1  # NATS took the second


async def test_a_superseded_worker_stops_heartbeating_and_says_so() -> None:
    h = Harness(interval_s=0.01)
    h.board.errors.append(WorkerSuperseded("w1 was taken over by another incarnation"))
    await asyncio.wait_for(h.presence.run(asyncio.Event()), 5.0)  # returns without being told
    assert h.presence.superseded.is_set() and h.superseded_calls == 1
    assert len(h.board.beats) == 1


async def test_deregistering_publishes_the_jobs_handed_back() -> None:
    h = Harness()
    h.workers.handed_back = ["j3"]
    await h.presence.deregister()
    assert h.workers.deregistered == [("w1", h.presence.incarnation)]
    assert h.statuses() == [WorkerStatus.GONE]  # said on NATS before the database hears it
    assert [(e.job_id, e.status) for e in h.events.published] == [("j3", None)]
    assert h.events.work_calls == 1


class IdOfASampler(FakeWorkers):
    async def register(self, hb: WorkerHeartbeat, incarnation: str) -> Registration:
        raise WorkerIdTaken(f"worker id {hb.id} is registered as a sampler")


async def test_an_id_a_worker_of_the_other_kind_holds_stops_it_as_a_bad_setting() -> None:
    h = Harness()
    h.presence.workers = IdOfASampler()
    with pytest.raises(SettingsError, match=r"w1 is registered as a sampler.*DARKROOM_WORKER_ID"):
        await asyncio.wait_for(h.presence.register(asyncio.Event()), 5.0)  # not retried as an outage
    assert h.board.beats == []  # never heard of on NATS
