"""The miniatures' parallel twins, for tests, the demo's groups and ``bench/parallel.py``
on a CPU: each tiny model of a family with a plan, again under another name, with
each parallel shape a group of ``size`` serves that its family (and its two attention
heads) takes (``tiny-flux``
becomes ``tiny-flux-sequence2``; ``tiny`` becomes ``tiny-cfg2``). The same weights:
a twin's image is its model's (docs/parallel.md says how closely)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.models.parallel import Parallelism, refusal, shapes_of
from services.models.registry import DEFAULT_REGISTRY, toml_value

BASES = ("tiny", "tiny-flux", "tiny-wan", "tiny-wan22", "tiny-qwen-image")
# The miniatures' attention heads: Ulysses splits them, so no twin splits its sequence more.
HEADS = 2


def twin_name(base: str, shape: Parallelism) -> str:
    return f"{base}-{shape.describe().replace('=', '').replace(',', '-')}"


def shipped(base: str, **keys: Any) -> dict[str, Any]:
    """The shipped registry's table of ``base`` (not as the default), with ``keys``."""
    table = tomllib.loads(DEFAULT_REGISTRY.read_text())["models"][base]
    return {**{k: v for k, v in table.items() if k != "default"}, **keys}


def twins(size: int, **overrides: Any) -> dict[str, dict[str, Any]]:
    """Each twin's registry table, by name (``overrides``: keys set on every twin)."""
    found: dict[str, dict[str, Any]] = {}
    for base in BASES:
        table = shipped(base)
        for shape in shapes_of(size):
            if refusal(table["family"], shape) is None and HEADS % shape.sequence == 0:
                found[twin_name(base, shape)] = {**table, **overrides, "parallel": shape.as_dict()}
    return found


def write_registry(
    path: Path, size: int = 2, variants: Mapping[str, Mapping[str, Any]] | None = None, **overrides: Any
) -> Path:
    """The shipped registry and the twins of ``size`` in one file at ``path``; each
    of ``variants`` (a suffix: keys) adds every twin again, suffixed, with its keys."""
    sections = [DEFAULT_REGISTRY.read_text()]
    tables = twins(size, **overrides)
    for suffix, keys in (variants or {}).items():
        tables |= {name + suffix: {**table, **keys} for name, table in twins(size, **overrides).items()}
    for name, table in tables.items():
        lines = [f'[models."{name}"]', *(f"{key} = {toml_value(value)}" for key, value in table.items())]
        sections.append("\n".join(lines))
    path.write_text("\n\n".join(sections) + "\n")
    return path
