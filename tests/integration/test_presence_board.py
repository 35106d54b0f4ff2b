"""Presence on a real nats-server (services/bus/presence_board.py and
services/presence_view.py): a view following the bucket hears heartbeats and plans
as they are written and a worker's stop; a newer incarnation of a worker id makes
the older one's next heartbeat fail as superseded; a view started later still
knows what the bucket held, aged; a view that lost NATS is unsettled until it
is back and has caught up; and in a sealed NATS, what the decoders' user writes
under a decoder key never speaks for, nor silences, a sampler of the same id."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest
from nats.js.api import KeyValueConfig

from scheduler.recovery import RecoveryConfig
from scheduler.stalled import recover_stalled
from services.bus.connection import connect_nats
from services.bus.credentials import NatsCredentials
from services.bus.presence_board import BUCKET, Announcement, PresenceBoard, worker_key
from services.db.repository import Repository
from services.db.states import JobStatus, WorkerKind, WorkerStatus
from services.db.worker_records import WarmPlan, WorkerHeartbeat
from services.errors import WorkerSuperseded
from services.mesh.nats_auth import CONTROL_USERS, DECODER_USER, sampler_user
from services.mesh.secrets import ensure_certificates
from services.ops.embedded_nats import EmbeddedNats
from services.presence_read import read_once
from services.presence_view import PresenceView, follow
from tests.integration.test_repository import age_registration, schedule, submit

pytestmark = [pytest.mark.integration, pytest.mark.quick]

WITHIN_S = 10.0


def announcement(worker_id: str, incarnation: str, status: WorkerStatus = WorkerStatus.READY) -> Announcement:
    hb = WorkerHeartbeat(worker_id, WorkerKind.SAMPLER, "127.0.0.1:1", "cpu", ("tiny",), (), status=status)
    return Announcement(hb, incarnation, 1_700_000_000.0)


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WITHIN_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {WITHIN_S}s: {what}"
        await asyncio.sleep(0.02)


def opener(nc: nats.NATS) -> Callable[[], Awaitable[PresenceBoard]]:
    async def open_board() -> PresenceBoard:
        return await PresenceBoard.open(nc.jetstream())

    return open_board


async def test_a_view_follows_heartbeats_plans_and_stops(nats_server: EmbeddedNats) -> None:
    worker, scheduler = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    stop = asyncio.Event()
    view = PresenceView((WorkerKind.SAMPLER, WorkerKind.DECODER))  # as the scheduler's: the whole bucket
    following = asyncio.create_task(follow(view, scheduler, opener(scheduler), stop))
    try:
        board = await PresenceBoard.open(worker.jetstream())
        await board.announce(announcement("w1", "inc-1"))
        await until(
            lambda: [w.id for w in view.live(WorkerKind.SAMPLER, stale_after_s=10)] == ["w1"] and view.settled_for(0),
            "w1 live, and the view settled",
        )

        plans = await PresenceBoard.open(scheduler.jetstream())
        await plans.store_plan("w1", WarmPlan("tiny", ("tiny",)))
        await until(lambda: view.plan("w1") == WarmPlan("tiny", ("tiny",)), "the plan in the view")
        assert await board.plan("w1") == WarmPlan("tiny", ("tiny",))  # what the worker reads back
        assert await board.plan("w2") is None

        await board.announce(announcement("w1", "inc-1", WorkerStatus.GONE))
        await until(lambda: view.live(WorkerKind.SAMPLER, stale_after_s=10) == [], "w1 gone")
        [gone] = view.all(WorkerKind.SAMPLER, stale_after_s=10)
        assert gone.status == WorkerStatus.GONE
    finally:
        stop.set()
        await following
        await worker.close()
        await scheduler.close()


async def test_a_newer_incarnation_supersedes_the_older_one(nats_server: EmbeddedNats) -> None:
    old_nc, new_nc = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    try:
        old, new = await PresenceBoard.open(old_nc.jetstream()), await PresenceBoard.open(new_nc.jetstream())
        await old.announce(announcement("w1", "inc-old"))
        await old.announce(announcement("w1", "inc-old"))  # its own revision: no conflict
        await new.announce(announcement("w1", "inc-new"))
        with pytest.raises(WorkerSuperseded, match="inc-new"):
            await old.announce(announcement("w1", "inc-old"))
        await new.announce(announcement("w1", "inc-new"))  # the newer one goes on
        [record] = await read_once(new_nc, stale_after_s=10)
        assert record.id == "w1" and record.live
    finally:
        await old_nc.close()
        await new_nc.close()


async def test_a_view_started_later_knows_the_bucket_and_waits_out_an_outage(nats_server: EmbeddedNats) -> None:
    worker = await nats.connect(nats_server.url)
    board = await PresenceBoard.open(worker.jetstream())
    await board.announce(announcement("w1", "inc-1"))
    await worker.close()

    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    stop = asyncio.Event()
    view = PresenceView((WorkerKind.SAMPLER,))
    following = asyncio.create_task(follow(view, nc, opener(nc), stop))
    try:
        await until(
            lambda: view.get(WorkerKind.SAMPLER, "w1") is not None and view.settled_for(0), "w1 from the bucket"
        )
        nats_server.stop()
        await until(lambda: not view.settled_for(0), "the view unsettled while NATS is away")
        nats_server.start()
        await until(lambda: view.settled_for(0), "the view settled again")
        assert view.get(WorkerKind.SAMPLER, "w1") is not None  # file storage: the bucket outlived the restart
    finally:
        stop.set()
        await following
        await nc.close()


async def test_a_bucket_made_with_other_settings_is_used_as_it_is(nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().create_key_value(KeyValueConfig(bucket=BUCKET, history=2))
        board = await PresenceBoard.open(nc.jetstream(), replicas=1)  # would make it with history 1
        await board.announce(announcement("w1", "inc-1"))
        assert [w.id for w in await read_once(nc, stale_after_s=10)] == ["w1"]
    finally:
        await nc.close()


async def test_a_view_that_hears_nothing_for_longer_than_it_expects_is_unsettled(nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    stop = asyncio.Event()
    view = PresenceView((WorkerKind.SAMPLER, WorkerKind.DECODER), expect_within_s=1.0)
    following = asyncio.create_task(follow(view, nc, opener(nc), stop))
    board = await PresenceBoard.open(nc.jetstream())

    async def beat() -> None:
        while not stop.is_set():
            await board.canary("replica-1")
            await asyncio.sleep(0.2)

    try:
        beating: asyncio.Task[None] | None = None
        await until(lambda: view.settled_for(0), "the view settled")
        first = view.clock()
        # Nothing written for longer than it expects: a silent watch is not a quiet fleet.
        # Unsettled, it watches again at once and settles anew: settled since after
        # `first` (polling for the unsettled moment itself could miss it).
        await until(lambda: not view.settled_for(view.clock() - first), "the view unsettled by the silence")
        beating = asyncio.create_task(beat())
        await until(lambda: view.settled_for(2.0), "the view settled for 2 s while the canary beats")
        assert view.all(WorkerKind.SAMPLER, stale_after_s=10) == []  # a canary is no worker
    finally:
        stop.set()
        await following
        if beating is not None:
            await beating
        await nc.close()


@pytest.fixture
def sealed_nats(tmp_path: Path) -> Iterator[Callable[[str, str], Awaitable[nats.NATS]]]:
    """A sealed nats-server of the test's own (the control users and sampler
    ``SAMPLER_ID``'s); yields how to connect to it as (role, user)."""
    mesh_dir = tmp_path / "mesh"
    ensure_certificates(mesh_dir, hosts=["127.0.0.1", "localhost"])
    server = EmbeddedNats(tmp_path / "nats", mesh_dir=mesh_dir, users=[*CONTROL_USERS, sampler_user(SAMPLER_ID)])
    server.start()

    async def connect(role: str, user: str) -> nats.NATS:
        url = f"tls://127.0.0.1:{server.port}"
        return await connect_nats([url], name=user, credentials=NatsCredentials.of(mesh_dir, role, user))

    yield connect
    server.stop()


SAMPLER_ID = "gpu-7"


async def test_a_decoder_whose_heartbeat_answer_was_lost_goes_on_in_a_sealed_nats(
    sealed_nats: Callable[[str, str], Awaitable[nats.NATS]],
) -> None:
    """An update whose answer was lost leaves the decoder's revision behind; its next
    heartbeat reads its own key back and goes on. In a sealed NATS the decoders'
    user may read it (it once could not: every later heartbeat failed, and the
    decoder dropped out of presence after a NATS node was cut off)."""
    scheduler = await sealed_nats("scheduler", "scheduler")
    decoder = await sealed_nats("decoder", DECODER_USER)
    try:
        await PresenceBoard.open(scheduler.jetstream())  # only the scheduler may make the bucket
        board = await PresenceBoard.open(decoder.jetstream(timeout=2), create=False, patience_s=5)
        hb = WorkerHeartbeat("host-decoder-0", WorkerKind.DECODER, "127.0.0.1:1", "cpu", ("tiny",), ())
        beat = Announcement(hb, "inc-1", 1_700_000_000.0)
        await board.announce(beat)
        await board.kv.put(worker_key(WorkerKind.DECODER, hb.id), beat.encode())  # its write, the answer lost
        await board.announce(beat)  # reads its key back: its own incarnation, so it goes on
        [record] = await read_once(scheduler, stale_after_s=10)
        assert (record.id, record.kind, record.live) == (hb.id, WorkerKind.DECODER, True)
    finally:
        await decoder.close()
        await scheduler.close()


async def test_the_decoders_user_neither_speaks_for_nor_silences_a_sampler(
    sealed_nats: Callable[[str, str], Awaitable[nats.NATS]], repo: Repository
) -> None:
    """The decoders' NATS user may write and delete any ``decoder.*`` key. Under
    ``decoder.gpu-7`` it neither changes what the scheduler's view says of sampler
    gpu-7 (a sampler's heartbeat there is refused; a decoder's is a decoder's) nor,
    deleting it, makes recovery take gpu-7 for dead and fail its running job."""
    scheduler = await sealed_nats("scheduler", "scheduler")
    sampler = await sealed_nats("sampler", sampler_user(SAMPLER_ID))
    decoder = await sealed_nats("decoder", DECODER_USER)
    stop = asyncio.Event()
    view = PresenceView((WorkerKind.SAMPLER, WorkerKind.DECODER))  # the scheduler's
    following = asyncio.create_task(follow(view, scheduler, opener(scheduler), stop))
    try:
        await PresenceBoard.open(scheduler.jetstream())
        own = await PresenceBoard.open(sampler.jetstream(timeout=2), create=False, patience_s=5)
        real = replace(announcement(SAMPLER_ID, "inc-1").heartbeat, telemetry={"cached": ["tiny"]})
        await own.announce(Announcement(real, "inc-1", 1_700_000_000.0))
        await until(lambda: len(view.live(WorkerKind.SAMPLER, stale_after_s=10)) == 1, "gpu-7 live")
        [before] = view.all(WorkerKind.SAMPLER, stale_after_s=10)

        board = await PresenceBoard.open(decoder.jetstream(timeout=2), create=False, patience_s=5)
        forged = replace(real, address="10.6.6.6:1", telemetry={"cached": ["evil"]})
        await board.kv.put(worker_key(WorkerKind.DECODER, SAMPLER_ID), Announcement(forged, "x", 0.0).encode())
        await board.announce(Announcement(replace(forged, kind=WorkerKind.DECODER), "x", 0.0))
        await until(lambda: len(view.all(WorkerKind.DECODER, stale_after_s=10)) == 1, "a decoder named gpu-7")
        assert view.all(WorkerKind.SAMPLER, stale_after_s=10) == [before]

        await board.kv.delete(worker_key(WorkerKind.DECODER, SAMPLER_ID))
        await until(lambda: view.all(WorkerKind.DECODER, stale_after_s=10) == [], "the decoder named gpu-7 deleted")
        assert view.all(WorkerKind.SAMPLER, stale_after_s=10) == [before]

        # Recovery, as the scheduler runs it, with gpu-7 heard only on NATS.
        await repo.workers.register(real, "inc-1")
        job_id = await submit(repo)
        attempt = await schedule(repo, job_id, SAMPLER_ID)
        await repo.attempts.start(job_id, attempt, SAMPLER_ID, now=datetime.now(UTC))
        age_registration(repo.db.url, SAMPLER_ID, 30)
        heard = view.ages(WorkerKind.SAMPLER)
        assert await recover_stalled(repo, RecoveryConfig(), stale_after_s=10, heard=heard) == []
        assert (await repo.jobs.get(job_id)).status == JobStatus.RUNNING
    finally:
        stop.set()
        await following
        for nc in (decoder, sampler, scheduler):
            await nc.close()
