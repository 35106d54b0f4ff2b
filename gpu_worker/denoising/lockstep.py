"""What keeps the ranks of a group in step through the denoising loop: the loop's
rank-local decisions (which members stop at a boundary; which failed as they were
prepared) made once, by the leader, and followed by every rank (``gpu_worker.group``).
A sampler alone decides for itself (``ALONE``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from gpu_worker.denoising.checkpoint_capture import MemberRun

R = TypeVar("R", bound=MemberRun)
T = TypeVar("T")


class Lockstep(Protocol):
    def stopping(self, candidates: Sequence[R]) -> list[R]:
        """Of the runs still stepping, those that stop at this boundary."""
        ...

    def agree(self, runs: Sequence[MemberRun]) -> None:
        """After members are prepared: a member that ended on any rank ends on every one."""
        ...

    def shared(self, leader_value: Callable[[], T]) -> T:
        """What the leader computes (``leader_value``, called on it alone; picklable,
        on the host), on every rank."""
        ...


class Alone:
    """A sampler that serves alone: its members' own flags decide."""

    def stopping(self, candidates: Sequence[R]) -> list[R]:
        return [r for r in candidates if r.member.stopping.is_set()]

    def agree(self, runs: Sequence[MemberRun]) -> None:
        pass

    def shared(self, leader_value: Callable[[], T]) -> T:
        return leader_value()


ALONE = Alone()
