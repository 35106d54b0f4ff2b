"""What becomes of a test that cannot run here (not root, a tool not installed):
skipped on a developer's machine, with its reason, and failed in CI. CI (``CI=true``,
as root, with every tool ``.ci/run`` installs) is meant to run every suite: a skip
there would let it pass with a suite never run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import pytest

Verdict = Literal["run", "skip", "fail"]


def in_ci(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is CI's: ``CI`` set to true (as CI services set it), 1 or yes."""
    return env.get("CI", "").strip().lower() in {"true", "1", "yes"}


def verdict(missing: str, env: Mapping[str, str]) -> tuple[Verdict, str]:
    """What becomes of a test that ``missing`` says cannot run here ('' where it can),
    and the reason to give."""
    if not missing:
        return "run", ""
    if in_ci(env):
        return "fail", f"{missing}; CI (CI={env['CI']}) is meant to run this suite, so it fails rather than skips"
    return "skip", missing


def require(missing: str, env: Mapping[str, str] | None = None) -> None:
    """In a test or a fixture: skips it where ``missing`` says why it cannot run here,
    fails it in CI; nothing where ``missing`` is ''."""
    what, reason = verdict(missing, os.environ if env is None else env)
    if what == "fail":
        pytest.fail(reason, pytrace=False)
    if what == "skip":
        pytest.skip(reason)
