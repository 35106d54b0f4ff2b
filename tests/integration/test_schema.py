"""The schema has one description, the SQLAlchemy models (``services/db/models.py``):
the migrations must build exactly it, and every record the repository reads or
writes must name only its columns. A migration that drifts from the models, or a
record field with no column, fails here rather than in production."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, create_engine

from services.db import records, worker_records
from services.db.migrate import (
    alembic_config,
    current_revision,
    newest_revision,
    schema_when_ready,
    sync_url,
    upgrade,
    upgrade_when_reachable,
)
from services.db.models import Base, JobCheckpointRow, JobImageRow, JobInputRow, JobRow, WorkerRow
from services.generation import JobInputs
from services.ops.embedded import EmbeddedPostgres
from services.ops.processes import free_port
from tests.conftest import fresh_database

pytestmark = [pytest.mark.integration, pytest.mark.quick]


def differences(url: str, metadata: MetaData) -> list[Any]:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def test_the_migrations_build_exactly_the_models(postgres: EmbeddedPostgres) -> None:
    url = fresh_database(postgres)
    upgrade(url)
    assert differences(url, Base.metadata) == []
    # The comparison sees a difference when there is one.
    drifted = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(drifted)
    Table("jobs", drifted, Column("not_migrated", Integer), extend_existing=True)
    assert [d[0] for d in differences(url, drifted)] == ["add_column"]


def columns(row: type) -> set[str]:
    return set(row.__table__.columns.keys())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("record", "row"),
    [
        (records.NewJob, JobRow),
        (records.JobRecord, JobRow),
        (records.JobSummary, JobRow),
        (records.ImageRecord, JobImageRow),
        (records.StoredCheckpoint, JobCheckpointRow),
        (JobInputs, JobInputRow),
    ],
)
def test_every_record_field_is_a_column(record: type, row: type) -> None:
    assert set(records.columns(record)) - columns(row) - STORED_APART.get(record, set()) == set()


# Fields a record holds whole that live in a table of their own: a new job's input
# image and mask (JobInputs, in job_inputs).
STORED_APART: dict[type, set[str]] = {records.NewJob: {"inputs"}}


def test_the_column_lists_read_only_columns() -> None:
    assert set(records.JOB_FIELDS) <= columns(JobRow)
    assert set(records.SUMMARY_FIELDS) <= columns(JobRow)
    assert set(worker_records.WORKER_FIELDS) <= columns(WorkerRow)


def test_the_newest_revision_read_from_the_files_is_alembics_head() -> None:
    from alembic.script import ScriptDirectory

    assert newest_revision() == ScriptDirectory.from_config(alembic_config()).get_current_head()


def test_a_database_a_revision_behind_is_brought_to_the_newest(postgres: EmbeddedPostgres) -> None:
    """The start's one-query check does not skip a migration still to run."""
    from alembic import command

    url = fresh_database(postgres)
    upgrade(url)
    cfg = alembic_config()
    engine = create_engine(sync_url(url))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "-1")
    finally:
        engine.dispose()
    behind = current_revision(url)
    assert behind is not None and behind != newest_revision()
    upgrade(url)
    assert current_revision(url) == newest_revision()
    assert differences(url, Base.metadata) == []


def test_a_start_on_a_database_at_the_newest_revision_does_not_import_alembic(postgres: EmbeddedPostgres) -> None:
    url = fresh_database(postgres)
    upgrade(url)
    probe = (
        "import sys; from services.db.migrate import upgrade; upgrade(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))"
    )
    done = subprocess.run([sys.executable, "-c", probe, url], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
    assert current_revision(url) == newest_revision()


async def test_a_start_waits_out_a_database_that_is_not_there_yet(postgres: EmbeddedPostgres) -> None:
    """Refused connections are retried until the stop; the same database reachable is migrated."""
    url = fresh_database(postgres)
    away = f"postgresql://127.0.0.1:{free_port()}/darkroom?user=darkroom&connect_timeout=1"
    stop = asyncio.Event()
    tried = asyncio.create_task(upgrade_when_reachable(away, stop, retry_max_s=0.05))
    waiting = asyncio.create_task(schema_when_ready(away, stop, retry_max_s=0.05))
    await asyncio.sleep(0.5)
    assert not tried.done() and not waiting.done()
    stop.set()
    assert await tried is False and await waiting is False
    assert await upgrade_when_reachable(url, asyncio.Event()) is True
    assert await schema_when_ready(url, asyncio.Event()) is True
