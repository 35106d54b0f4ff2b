"""How a record maps onto the columns of its table: its fields, each nested type
(the generation parameters, a shape, a batch key) by its own fields."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from services.generation import AdapterUse, BatchKey, GenerationParams, JobShape

# Records hold these types whole; the table holds their fields as columns.
_NESTED: tuple[type, ...] = (GenerationParams, JobShape, BatchKey)


def _adapters_to_column(adapters: tuple[AdapterUse, ...]) -> list[dict[str, Any]]:
    return [
        {"name": a.name, "version": a.version, "scale": a.scale, **({"owner": a.owner} if a.owner else {})}
        for a in adapters
    ]


def _adapters_from_column(rows: list[dict[str, Any]]) -> tuple[AdapterUse, ...]:
    return tuple(AdapterUse(r["name"], r["version"], float(r["scale"]), r.get("owner", "")) for r in rows)


# Columns that hold a field in a form of their own (JSON): to it, and from it.
_CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "adapters": (_adapters_to_column, _adapters_from_column),
}


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, type | None, tuple[str, ...]], ...]:
    # Per field: its name, the nested type it holds whole (or None), and that type's
    # fields. Cached: resolving the annotations costs more than reading a row.
    hints = typing.get_type_hints(cls)
    layout = []
    for f in fields(cls):
        kind = hints[f.name]
        nested = kind in _NESTED
        layout.append((f.name, kind if nested else None, tuple(g.name for g in fields(kind)) if nested else ()))
    return tuple(layout)


def columns(cls: type) -> tuple[str, ...]:
    """The columns ``cls`` is read from: its fields, a nested type's by its own."""
    names: list[str] = []
    for name, kind, inner in _layout(cls):
        names += inner if kind else [name]
    return tuple(names)


def flat(record: Any) -> dict[str, Any]:
    """``record``'s values by column (the inverse of ``values_of``)."""
    out: dict[str, Any] = {}
    cls: type = type(record)
    for name, kind, inner in _layout(cls):
        value = getattr(record, name)
        if kind:
            out.update({column: _to_column(column, getattr(value, column)) for column in inner})
        else:
            out[name] = _to_column(name, value)
    return out


def values_of(cls: type, row: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, kind, inner in _layout(cls):
        if kind:
            values[name] = kind(**{column: _from_column(column, row[column]) for column in inner})
        elif name in row:
            values[name] = _from_column(name, row[name])
    return values


def _to_column(column: str, value: Any) -> Any:
    codec = _CODECS.get(column)
    return codec[0](value) if codec else value


def _from_column(column: str, value: Any) -> Any:
    codec = _CODECS.get(column)
    return codec[1](value) if codec else value
