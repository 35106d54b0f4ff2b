"""The declarative base every table of the schema is defined on: one metadata,
which Alembic and ``tests/integration/test_schema.py`` read through ``models.py``."""

from __future__ import annotations

from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    pass
