"""The passwords the platform makes for its own parts (PostgreSQL's, NATS users',
the model store's) travel as command-line arguments and in URLs."""

from __future__ import annotations

import stat
import string
from pathlib import Path

from services.mesh.secrets import password


def test_a_made_password_is_never_read_as_an_option_and_needs_no_quoting(tmp_path: Path) -> None:
    made = [password(tmp_path / f"{i}.password") for i in range(500)]
    # URL-safe base64 began with "-" once in 64 (pg_autoctl then took it for an option).
    assert not [p for p in made if p.startswith("-")]
    assert all(set(p) <= set(string.hexdigits) and len(p) >= 32 for p in made)
    assert len(set(made)) == len(made)


def test_a_kept_password_is_read_back_and_private(tmp_path: Path) -> None:
    path = tmp_path / "db.password"
    first = password(path)
    assert password(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
