"""A registry for tests of ``store:`` models: the shipped one and the tiny model's
entry under another name, its weights from the model store."""

from __future__ import annotations

import tomllib
from pathlib import Path

from services.models import registry


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def write_store_registry(path: Path, name: str, reference: str | None = None) -> Path:
    """The shipped registry with ``[models.NAME]``: the tiny model's fields, its
    source ``store:REFERENCE`` (``NAME``, its latest version, by default)."""
    shipped = Path(registry.__file__).with_name("default_registry.toml")
    tiny = tomllib.loads(shipped.read_text())["models"]["tiny"]
    fields = {k: v for k, v in tiny.items() if k not in ("source", "default")}
    lines = [f"[models.{name}]", f'source = "store:{reference or name}"']
    lines += [f"{key} = {_toml_value(value)}" for key, value in fields.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(shipped.read_text() + "\n" + "\n".join(lines) + "\n")
    return path
