"""Which dispatched jobs run together: pure, over what the worker holds in hand."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol


class Batchable(Protocol):
    @property
    def key(self) -> Hashable | None: ...  # None: runs alone (its job could not be read)

    @property
    def rows(self) -> int: ...  # images it adds to a batch


def next_batch(inbox: Sequence[Batchable], max_rows: Callable[[Hashable], int]) -> tuple[list[int], bool]:
    """Indexes into ``inbox`` of the next batch: the oldest job and, in order, the
    later ones of its key that fit within the key's ``max_rows``. Also whether the
    batch is full (no job of its key, however small, could join it)."""
    first = inbox[0]
    if first.key is None:
        return [0], True
    limit = max_rows(first.key)
    chosen, rows = [0], first.rows
    for i, pending in enumerate(inbox[1:], start=1):
        if pending.key == first.key and rows + pending.rows <= limit:
            chosen.append(i)
            rows += pending.rows
    return chosen, rows >= limit
