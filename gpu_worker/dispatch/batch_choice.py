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


class Joinable(Protocol):
    @property
    def join_key(self) -> Hashable | None: ...  # None: runs alone

    @property
    def rows(self) -> int: ...


def joiners(inbox: Sequence[Joinable], key: Hashable, free_rows: int) -> list[int]:
    """Indexes into ``inbox`` of the jobs that join the running batch of join key
    ``key`` with ``free_rows`` images of room: from the oldest, while each is of its
    key and fits. The first that is not stops the count, so that a batch that keeps
    taking jobs in never starves older work of another shape (that work waits for
    the batch to end, then runs)."""
    chosen: list[int] = []
    for i, pending in enumerate(inbox):
        if pending.join_key != key or pending.rows > free_rows:
            break
        chosen.append(i)
        free_rows -= pending.rows
    return chosen


class PassArrivals:
    """How many of the jobs each scheduling pass sent this worker have not arrived:
    jobs placed together are published together, and a worker waits for the rest
    of a pass before it forms a batch, not for jobs nobody announced."""

    def __init__(self) -> None:
        self._missing: dict[str, tuple[int, float]] = {}  # pass id -> (jobs still to come, first arrival)

    def arrived(self, pass_id: str, pass_jobs: int, now: float) -> None:
        if not pass_id or pass_jobs <= 1:
            return
        missing, first = self._missing.get(pass_id, (pass_jobs, now))
        if missing <= 1:
            self._missing.pop(pass_id, None)
        else:
            self._missing[pass_id] = (missing - 1, first)

    def wait_s(self, now: float, patience_s: float) -> float:
        """How much longer to wait for jobs still to come of passes that began
        arriving less than ``patience_s`` ago; 0 when none (a pass older than that
        is forgotten: a job of it was lost, or dropped as a duplicate)."""
        for pass_id, (_, first) in list(self._missing.items()):
            if now - first >= patience_s:
                del self._missing[pass_id]
        return max((first + patience_s - now for _, first in self._missing.values()), default=0.0)
