"""Writes ``docs/settings.md`` from the settings' own definitions, or checks that
the committed page is current (CI runs ``--check``, as it does for the gRPC code):

    python -m services.config.docs [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.config.fields import Section, Setting
from services.config.sections import Settings

# How the page names the parts of Settings that read a section.
READERS = {
    "kernel": "every service",
    "supervisor": "`darkroom up` and `darkroom supervise`",
    "http": "the HTTP API",
}
PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
INTRO = """# Settings

Every setting is a `DARKROOM_*` environment variable, read when a service starts:
parsed, range-checked, and a bad one stops the service with the variable's name.
Each service reads the kernel's settings and its own; `darkroom up` and `darkroom
supervise` read them all and pass them to the processes they start. The
simulator's scenario files take the placement and preemption settings under
`[darkroom]` and `[darkroom.preemption]`, by the names in the *field* column, with
the same defaults and checks.

This page is generated from `services/config/` (`python -m services.config.docs`);
CI fails when it is stale.
"""


def _default(s: Setting) -> str:
    assert s.codec is not None
    text = s.codec.to_text(s.default)
    if s.name == "data_dir":
        text = "~/.darkroom"
    return f"`{text}`" if text else "(empty)"


def _range(s: Setting) -> str:
    spec = s.spec
    parts = []
    if spec.choices:
        parts.append(" or ".join(f"`{c}`" for c in spec.choices))
    if spec.minimum is not None:
        parts.append(f"≥ {spec.minimum:g}")
    if spec.maximum is not None:
        parts.append(f"≤ {spec.maximum:g}")
    assert s.codec is not None
    return ", ".join([s.codec.kind, *parts])


def _rows(section: type[Section]) -> list[str]:
    return [
        f"| `{s.variable}` | `{s.name}` | {_default(s)} | {_range(s)} | {s.spec.doc} |"
        for s in section.settings()
        if s.nested is None
    ]


def _readers() -> list[tuple[type[Section], list[str]]]:
    """Each section once, in order, with the parts of Darkroom that read it."""
    found: dict[type[Section], list[str]] = {}

    def walk(section: type[Section], reader: str) -> None:
        found.setdefault(section, []).append(reader)
        for s in section.settings():
            if s.nested is not None:
                walk(s.nested, reader)

    for part in Settings.settings():
        assert part.nested is not None
        walk(part.nested, part.name)
    return list(found.items())


def render() -> str:
    lines = [INTRO]
    for section, readers in _readers():
        rows = _rows(section)
        if not rows:
            continue
        title = section.__name__.removesuffix("Settings").lower()
        read_by = ", ".join(READERS.get(r, f"the {r}") for r in dict.fromkeys(readers))
        doc = " ".join((section.__doc__ or "").split()).replace("``", "`")
        lines += [f"## {title}", "", f"{doc} Read by {read_by}.", ""]
        lines += ["| variable | field | default | value | meaning |", "|---|---|---|---|---|", *rows, ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if docs/settings.md is not what would be written")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is stale: run python -m services.config.docs", file=sys.stderr)
            return 1
        print("docs/settings.md is up to date")
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
