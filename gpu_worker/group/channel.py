"""The leader's channel to its followers, over the group's gloo control group: each
command the leader's engine runs (a load, a batch) is sent before it runs, and inside
a batch each boundary's decisions (``Lockstep``) and each joiner. Only the leader
reads its dispatch, its database and its members' flags; a follower runs what it is
sent, exactly as the leader does, so that every collective meets its peers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.denoising.checkpoint_capture import MemberRun
from gpu_worker.denoising.group_mesh import GroupError, GroupMesh
from gpu_worker.denoising.lockstep import R
from gpu_worker.denoising.members import BatchMember, MemberInputs
from gpu_worker.denoising.prompts import Conditioning
from gpu_worker.denoising.running_batch import BatchJoins, Cohort
from services.generation import GenerationParams
from services.models.video_tiles import TileGrid

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class MemberSpec:
    """A member as a follower rebuilds it: what it computes from, none of its callbacks."""

    params: GenerationParams
    resume: Checkpoint | None
    inputs: MemberInputs | None

    @classmethod
    def of(cls, member: BatchMember, inputs: MemberInputs | None = None) -> MemberSpec:
        """``member`` with its inputs (or ``inputs``) on the host: a follower's device is its own."""
        return cls(member.params, member.resume, _on_host(inputs if inputs is not None else member.inputs))

    def member(self) -> BatchMember:
        return BatchMember(self.params, _no_step, threading.Event(), resume=self.resume, inputs=self.inputs)


@dataclass(frozen=True)
class Load:
    name: str
    drop: tuple[str, ...] = ()  # the leader's evictions since its last command


@dataclass(frozen=True)
class Sample:
    members: tuple[MemberSpec, ...]
    joins: bool  # a running batch: members join at its boundaries
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decode:
    """A tiled video's latents (on the host), every rank decoding its share of the tiles."""

    model: str
    latents: torch.Tensor
    grid: TileGrid
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shutdown:
    drop: tuple[str, ...] = ()


Command = Load | Sample | Decode | Shutdown


class Channel:
    """Rank 0 sends; every other rank receives the same objects in the same order."""

    def __init__(self, mesh: GroupMesh) -> None:
        self.mesh = mesh

    def send(self, value: Any) -> None:
        dist.broadcast_object_list([value], src=0, group=self.mesh.control)

    def receive(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.mesh.control)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        found: list[Any] = [None] * self.mesh.size
        dist.all_gather_object(found, value, group=self.mesh.control)
        return found

    def collect(self, value: Any) -> list[Any] | None:
        """Every rank's ``value``, on the leader only (None elsewhere): for what only it uses."""
        found: list[Any] | None = [None] * self.mesh.size if self.mesh.rank == 0 else None
        dist.gather_object(value, found, group=self.mesh.control, group_dst=0)
        return found


class _Agreement:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def agree(self, runs: Sequence[MemberRun]) -> None:
        """A member that ended as it was prepared on any rank (its inputs, its
        adapters, a stop seen only by the leader) ends on every rank."""
        mine = [None if r.result is None else f"{type(r.result).__name__}: {r.result}" for r in runs]
        every = self.channel.gather(mine)
        for i, run in enumerate(runs):
            if run.result is not None:
                continue
            ended = [(rank, found[i]) for rank, found in enumerate(every) if found[i] is not None]
            if ended:
                rank, why = ended[0]
                run.result = GroupError(f"rank {rank} of its group: {why}")


class LeaderLockstep(_Agreement):
    """The leader decides each boundary's stops and tells its followers (and its
    watchdog, ``on_boundary``, that one was reached)."""

    def __init__(self, channel: Channel, on_boundary: Callable[[], None] = lambda: None) -> None:
        super().__init__(channel)
        self.on_boundary = on_boundary

    def stopping(self, candidates: Sequence[R]) -> list[R]:
        self.on_boundary()
        chosen = [i for i, r in enumerate(candidates) if r.member.stopping.is_set()]
        self.channel.send(chosen)
        return [candidates[i] for i in chosen]

    def shared(self, leader_value: Callable[[], T]) -> T:
        value = leader_value()
        self.channel.send(value)
        return value


class FollowerLockstep(_Agreement):
    """A follower stops the members its leader stops."""

    def stopping(self, candidates: Sequence[R]) -> list[R]:
        chosen: list[int] = self.channel.receive()
        return [candidates[i] for i in chosen]

    def shared(self, leader_value: Callable[[], T]) -> T:
        value: T = self.channel.receive()
        return value


class SentJoins:
    """The leader's running batch: each boundary's joiners also go to its followers
    (``spec_of``: each as it is sent)."""

    def __init__(self, joins: BatchJoins, channel: Channel, spec_of: Callable[[BatchMember], MemberSpec]) -> None:
        self.joins, self.channel, self.spec_of = joins, channel, spec_of

    def joining(self) -> list[BatchMember]:
        return self._sent(self.joins.joining())

    def close(self) -> list[BatchMember]:
        return self._sent(self.joins.close())

    def _sent(self, members: list[BatchMember]) -> list[BatchMember]:
        self.channel.send([self.spec_of(m) for m in members])
        return members

    def stepped(self, members: Sequence[BatchMember], steps_left: int) -> None:
        self.joins.stepped(members, steps_left)

    def leave(self, cohort: Cohort) -> None:
        self.joins.leave(cohort)


class ReceivedJoins:
    """A follower's side of its leader's running batch: the same joiners at the same
    boundaries; what leaves is the leader's to hand out."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def joining(self) -> list[BatchMember]:
        specs: list[MemberSpec] = self.channel.receive()
        return [s.member() for s in specs]

    close = joining

    def stepped(self, members: Sequence[BatchMember], steps_left: int) -> None:
        pass

    def leave(self, cohort: Cohort) -> None:
        pass


def failure_text(exc: BaseException | None) -> str | None:
    """What a rank sends of a failure: its type and words, or None."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def _on_host(inputs: MemberInputs | None) -> MemberInputs | None:
    if inputs is None:
        return None
    moved: dict[str, Any] = {
        f.name: value.to(torch.device("cpu"))
        for f in fields(inputs)
        if isinstance(value := getattr(inputs, f.name), torch.Tensor | Conditioning)
    }
    return replace(inputs, **moved)


def _no_step(step: int, total: int) -> None:
    pass
