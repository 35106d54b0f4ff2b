"""How a settings section is written and read. A field says once what it is: its
variable, default, range and meaning (``setting``). A section (``Section``) is a
frozen dataclass of such fields, parsed from the environment or from a TOML table
by the same code, range-checked in one place, failing fast with the name of the
variable (or key) that is wrong. ``services.config.docs`` writes the reference
from the same definitions."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

ENV_PREFIX = "DARKROOM_"


class SettingsError(ValueError):
    """A setting holds a value that cannot be used."""


@dataclass(frozen=True)
class Codec:
    """One kind of value: read from a variable's text and from TOML, written back as
    text. Its readers raise ValueError saying what is wrong."""

    kind: str  # what the docs call it
    from_text: Callable[[str], Any]
    from_toml: Callable[[Any], Any]
    to_text: Callable[[Any], str] = str


def _number(kind: type) -> Codec:
    def from_toml(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and isinstance(value, float)):
            raise ValueError(f"expected {'a whole number' if kind is int else 'a number'}")
        return kind(value)

    return Codec(
        "whole number" if kind is int else "number", kind, from_toml, lambda v: repr(v) if kind is float else str(v)
    )


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool_from_text(raw: str) -> bool:
    word = raw.strip().lower()
    if word not in _TRUE | _FALSE:
        raise ValueError("expected true or false")
    return word in _TRUE


def _bool_from_toml(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def _text_from_toml(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def _names_from_text(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _names_from_toml(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of names")
    return tuple(value)


INT = _number(int)
FLOAT = _number(float)
BOOL = Codec("true or false", _bool_from_text, _bool_from_toml, lambda v: "true" if v else "false")
TEXT = Codec("text", str, _text_from_toml)
PATH = Codec("path", lambda raw: Path(raw).expanduser(), lambda v: Path(_text_from_toml(v)).expanduser())
NAMES = Codec("comma-separated names", _names_from_text, _names_from_toml, ",".join)
NAME_SET = Codec(
    "comma-separated names",
    lambda raw: frozenset(_names_from_text(raw)),
    lambda v: frozenset(_names_from_toml(v)),
    lambda v: ",".join(sorted(v)),
)
# The codec of each plain type a field may have; any other type names its codec.
CODECS: dict[Any, Codec] = {
    int: INT,
    float: FLOAT,
    bool: BOOL,
    str: TEXT,
    Path: PATH,
    tuple[str, ...]: NAMES,
    frozenset[str]: NAME_SET,
}


@dataclass(frozen=True)
class Spec:
    doc: str
    env: str  # the variable's name, less ENV_PREFIX
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    codec: Codec | None = None


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    env: str = "",
    at_least: float | None = None,
    at_most: float | None = None,
    choices: tuple[str, ...] = (),
    codec: Codec | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    spec = Spec(doc, env, at_least, at_most, choices, codec)
    if factory is not None:
        return field(default_factory=factory, metadata={"spec": spec})
    return field(default=default, metadata={"spec": spec})


@dataclass(frozen=True)
class Setting:
    """A field of a section, resolved: its codec, or the section it nests."""

    name: str
    spec: Spec
    codec: Codec | None
    nested: type[Section] | None
    default: Any

    @property
    def variable(self) -> str:
        return ENV_PREFIX + (self.spec.env or self.name.upper())


# While values come from TOML tables, errors name a section's fields by their keys
# there (section class -> its table's dotted key); otherwise by their variables.
_tables: contextvars.ContextVar[Mapping[type, str] | None] = contextvars.ContextVar("tables", default=None)


@contextlib.contextmanager
def naming_tables(tables: Mapping[type, str]) -> Iterator[None]:
    """Errors raised meanwhile name the fields of these sections by their keys in
    these tables (for checks made after the tables are read)."""
    token = _tables.set({**(_tables.get() or {}), **tables})
    try:
        yield
    finally:
        _tables.reset(token)


def name_of(owner: type[Section], field_name: str) -> str:
    """How errors name a field now: its variable, or its key in the table being read."""
    where = (_tables.get() or {}).get(owner)
    return f"{where}.{field_name}" if where is not None else owner.setting(field_name).variable


class Section:
    """A frozen dataclass of settings (subclasses are ``@dataclass(frozen=True)``)."""

    _resolved: ClassVar[dict[type, tuple[Setting, ...]]] = {}

    @classmethod
    def settings(cls) -> tuple[Setting, ...]:
        found = Section._resolved.get(cls)
        if found is None:
            hints = typing.get_type_hints(cls)
            resolved = []
            for f in dataclasses.fields(cls):  # type: ignore[arg-type]
                spec = f.metadata.get("spec")
                if spec is None:
                    raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
                kind = hints[f.name]
                nested = kind if isinstance(kind, type) and issubclass(kind, Section) else None
                codec = spec.codec or CODECS.get(kind)
                if codec is None and nested is None:
                    raise TypeError(f"{cls.__name__}.{f.name}: no codec for {kind!r}; name one with setting(codec=...)")
                factory = typing.cast(Callable[[], Any], f.default_factory)
                default = f.default if f.default is not dataclasses.MISSING else factory()
                resolved.append(Setting(f.name, spec, codec, nested, default))
            found = Section._resolved[cls] = tuple(resolved)
        return found

    @classmethod
    def setting(cls, name: str) -> Setting:
        return next(s for s in cls.settings() if s.name == name)

    @classmethod
    def variables(cls) -> set[str]:
        """Every variable this section (and those it nests) reads."""
        found = set()
        for s in cls.settings():
            found |= s.nested.variables() if s.nested is not None else {s.variable}
        return found

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for s in cls.settings():
            if s.nested is not None:
                values[s.name] = s.nested.from_env(env)
            elif s.variable in env:
                raw = env[s.variable]
                assert s.codec is not None
                values[s.name] = _read(s.variable, raw, s.codec.from_text)
        return cls(**values)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str) -> Self:
        """From a TOML table at ``where`` (its dotted key, for errors): a key it
        does not know is an error, as is a value of the wrong kind."""
        known = {s.name: s for s in cls.settings()}
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise SettingsError(f"{where}: unknown keys {unknown}")
        values: dict[str, Any] = {}
        for name, value in table.items():
            s = known[name]
            if s.nested is not None:
                if not isinstance(value, dict):
                    raise SettingsError(f"{where}.{name}: expected a table")
                values[name] = s.nested.from_table(value, f"{where}.{name}")
            else:
                assert s.codec is not None
                values[name] = _read(f"{where}.{name}", value, s.codec.from_toml)
        with naming_tables({cls: where}):
            return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The variables that give these settings to another process."""
        env: dict[str, str] = {}
        for s in self.settings():
            value = getattr(self, s.name)
            if s.nested is not None:
                env.update(value.to_env())
            else:
                assert s.codec is not None
                env[s.variable] = s.codec.to_text(value)
        return env

    def __post_init__(self) -> None:
        for s in self.settings():
            if s.nested is None:
                _check_range(type(self), s, getattr(self, s.name))
        self.check()

    def check(self) -> None:
        """Checks across fields, for a section to add (raising SettingsError)."""


def _read(name: str, raw: Any, parse: Callable[[Any], Any]) -> Any:
    try:
        return parse(raw)
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"{name}={raw!r}: {exc}") from None


def _check_range(owner: type[Section], s: Setting, value: Any) -> None:
    spec = s.spec
    low, high = spec.minimum, spec.maximum
    if low is not None and not (isinstance(value, int | float) and math.isfinite(value) and value >= low):
        raise SettingsError(f"{name_of(owner, s.name)}={value!r}: must be a number of at least {low:g}")
    if high is not None and value > high:
        raise SettingsError(f"{name_of(owner, s.name)}={value!r}: must be at most {high:g}")
    if spec.choices and value not in spec.choices:
        raise SettingsError(f"{name_of(owner, s.name)}={value!r}: must be one of {', '.join(spec.choices)}")
