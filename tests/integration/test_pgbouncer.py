"""A real PgBouncer in transaction mode in front of the test session's PostgreSQL:
many pooled clients share a few server connections, the statements Darkroom runs
often (prepared on a direct connection) run through it, and a transaction's
advisory lock holds as it does directly."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest

from services.config.sections import KernelSettings
from services.db.migrate import upgrade
from services.db.repository import Repository
from services.db.repository.database import Database, libpq_url, lock
from services.ops.embedded import EmbeddedPostgres
from services.ops.host import Migrations
from services.ops.pgbouncer import PGBOUNCER_BIN, PgBouncer, auth_file_line, parse_upstream
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import fresh_database, make_stack, migrated_database
from tests.helpers import env_of, stub, wait_terminal
from tests.needs import require
from tests.records import new_job

pytestmark = pytest.mark.integration

POOL = 2
SERVER_CAP = 3
CLIENTS = 40


@pytest.fixture(scope="module")
def upstream(postgres: EmbeddedPostgres) -> str:
    url = migrated_database(postgres)
    return url


@pytest.fixture(scope="module")
def bouncer(tmp_path_factory: pytest.TempPathFactory, upstream: str) -> Iterator[PgBouncer]:
    require("" if Path(PGBOUNCER_BIN).exists() else f"no pgbouncer at {PGBOUNCER_BIN} (apt-get install pgbouncer)")
    b = PgBouncer(tmp_path_factory.mktemp("pgbouncer"), upstream, pool_size=POOL, max_db_connections=SERVER_CAP)
    b.start()
    try:
        yield b
    finally:
        b.stop()


def server_connections(upstream: str) -> int:
    """Backends on the database other than this one: PgBouncer's."""
    with psycopg.connect(libpq_url(upstream), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_many_clients_share_a_bounded_server_pool(bouncer: PgBouncer, upstream: str) -> None:
    dbs = [Database(bouncer.url, pool_size=1, pooled=True, application_name=f"fake-{i}") for i in range(CLIENTS)]
    peak = 0
    try:

        async def client(db: Database) -> int:
            total = 0
            # More than psycopg's prepare threshold (5): prepared, it would fail on
            # the server connection the next transaction gets.
            for i in range(8):
                row = await db.one("SELECT %s::int + 1 AS n", (i,))
                assert row is not None
                total += row["n"]
            return total

        async def watch(done: asyncio.Event) -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, await asyncio.to_thread(server_connections, upstream))
                await asyncio.sleep(0)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        totals = await asyncio.gather(*(client(db) for db in dbs))
        done.set()
        await watcher
        assert totals == [sum(range(1, 9))] * CLIENTS
        # Every client still holds its (idle) connection to PgBouncer; PostgreSQL
        # sees no more than the cap.
        assert sum(len(db._idle) for db in dbs) == CLIENTS
        assert 1 <= server_connections(upstream) <= SERVER_CAP
        assert peak <= SERVER_CAP
    finally:
        await asyncio.gather(*(db.close() for db in dbs))


async def test_a_repository_works_through_it(bouncer: PgBouncer) -> None:
    repo = Repository(bouncer.url, pool_size=1, pooled=True)
    try:
        for i in range(7):
            job = new_job(id=str(uuid.uuid4()), prompt=f"p{i}", seed=i)
            record, earlier = await repo.jobs.create(job, now=datetime.now(UTC))
            assert not earlier
            assert (await repo.jobs.get(job.id)).id == record.id
    finally:
        await repo.close()


async def test_a_transactions_advisory_lock_holds_through_it(bouncer: PgBouncer) -> None:
    first, second = Database(bouncer.url, pooled=True), Database(bouncer.url, pooled=True)
    key = 0x5047424E
    try:
        async with first.tx() as conn:
            await lock(conn, key)
            async with second.connection() as other:
                row = await (await other.execute("SELECT pg_try_advisory_xact_lock(%s) AS got", (key,))).fetchone()
                assert row is not None and row["got"] is False
        # Committed: the lock went with the transaction, whichever server connection it was on.
        async with second.connection() as other:
            row = await (await other.execute("SELECT pg_try_advisory_xact_lock(%s) AS got", (key,))).fetchone()
            assert row is not None and row["got"] is True
    finally:
        await first.close()
        await second.close()


def test_it_never_runs_as_root(bouncer: PgBouncer) -> None:
    assert bouncer.proc is not None
    assert psutil.Process(bouncer.proc.pid).uids().real != 0
    # Its files hold the password: its own (root's, when root starts it) and private.
    for path in (bouncer.config_path, Path(bouncer.data_dir / "userlist.txt")):
        assert path.stat().st_mode & 0o077 == 0
        assert path.stat().st_uid == os.geteuid()


def test_the_login_is_the_upstreams_and_the_server_is_pgbouncer(bouncer: PgBouncer, upstream: str) -> None:
    through = parse_upstream(bouncer.url)
    direct = parse_upstream(upstream)
    assert (through.host, through.port) == ("127.0.0.1", str(bouncer.port))
    assert (through.user, through.password, through.database) == (direct.user, direct.password, direct.database)
    assert direct.password
    assert auth_file_line('a"b', 'p"w') == '"a""b" "p""w"\n'


def test_a_sampler_behind_pgbouncer_runs_jobs(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path, bouncer_dir: Path
) -> None:
    """A stack with no sampler of its own, and one added whose database is a
    PgBouncer (DARKROOM_DATABASE_POOLED): its jobs start, decode and succeed."""
    stack = make_stack(tmp_path / "stack", postgres, models_dir, samplers=0)
    stack.start()
    bouncer = PgBouncer(bouncer_dir, stack.settings.kernel.database_url, pool_size=1)
    bouncer.start()
    try:
        stack.add(
            "sampler-pooled",
            "sampler",
            {
                "DARKROOM_DEVICE": "cpu",
                "DARKROOM_WORKER_ID": "pooled-0",
                **env_of(database_url=bouncer.url, database_pooled=True),
            },
        )
        client = stub(stack)
        # More jobs than psycopg's prepare threshold: every statement runs unprepared.
        ids = [
            client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt=f"p{i}", steps=2, seed=i)).job_id
            for i in range(8)
        ]
        jobs = [wait_terminal(client, job_id) for job_id in ids]
        assert [(j.status, j.worker_id) for j in jobs] == [(pb.JOB_STATUS_SUCCEEDED, "pooled-0")] * len(ids)
        assert all(j.images for j in jobs)
    finally:
        stack.stop()
        bouncer.stop()


@pytest.fixture
def bouncer_dir(tmp_path: Path) -> Path:
    require("" if Path(PGBOUNCER_BIN).exists() else f"no pgbouncer at {PGBOUNCER_BIN} (apt-get install pgbouncer)")
    return tmp_path / "pgbouncer"


async def test_a_pooled_service_waits_for_the_schema_and_never_migrates(
    bouncer: PgBouncer, postgres: EmbeddedPostgres
) -> None:
    fresh = fresh_database(postgres)  # no schema yet
    database = urlsplit(fresh).path.lstrip("/")
    pooled_url = bouncer.url_of(database)
    kernel = KernelSettings.from_env(env_of(database_url=pooled_url, database_pooled=True))
    stop = asyncio.Event()
    waiting = asyncio.create_task(Migrations(kernel).start(stop))
    await asyncio.sleep(1.0)
    assert not waiting.done(), "a pooled service went on without the schema"
    with psycopg.connect(libpq_url(fresh)) as conn:
        assert conn.execute("SELECT to_regclass('alembic_version')").fetchone() == (None,), "it migrated"
    upgrade(fresh)  # the migration, straight to the server
    assert await asyncio.wait_for(waiting, 30) is True
