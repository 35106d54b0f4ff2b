"""Reading what another process says of itself (a heartbeat and its telemetry, in
the presence bucket): each value taken only where it is of the type and range a
worker of this version sends, else the default. A worker of another version, or a
forged entry (any decoder may write any ``decoder.*`` key), must never stop the
scheduler, a gateway or a sampler that reads it, nor reach protobuf or arithmetic
as a value they refuse."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1


def number(values: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    """A finite int or float; ``default`` for anything else (a string, a bool, NaN)."""
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    value = float(value) if abs(value) < 1e300 else math.inf
    return value if math.isfinite(value) else default


def count(values: Mapping[str, Any], key: str, default: int = 0, *, most: int = UINT32) -> int:
    """An int in ``[0, most]``; ``default`` for anything else."""
    value = values.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        return default
    return value


def text(values: Mapping[str, Any], key: str, default: str = "") -> str:
    value = values.get(key)
    return value if isinstance(value, str) else default


def texts(values: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """A list of strings; its other entries passed over, and () for a non-list."""
    value = values.get(key)
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list | tuple) else ()
