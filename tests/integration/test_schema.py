"""The schema has one description, the SQLAlchemy models (``services/db/models.py``):
the migrations must build exactly it, and every record the repository reads or
writes must name only its columns. A migration that drifts from the models, or a
record field with no column, fails here rather than in production."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, create_engine

from services.db import records, worker_records
from services.db.migrate import sync_url, upgrade
from services.db.models import Base, JobCheckpointRow, JobImageRow, JobInputRow, JobRow, WorkerRow
from services.generation import JobInputs
from services.ops.embedded import EmbeddedPostgres
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
