"""A batch member's denoising state going into checkpoints and coming back out, at
step boundaries: where it starts (step 0, or the checkpoint it was given), the
periodic checkpoints its model's policy asks for, and the checkpoint it leaves with
when it is stopped and asked to suspend. The bytes are ``gpu_worker.checkpoints.format``'s.

A checkpoint that does not fit (another request, another kind of device, another
dtype) costs its job the steps it saved, never another image: the job runs from
step 0. A failed capture never fails a job either: a periodic checkpoint only saves
time on a resume, and a suspension that cannot be captured becomes an interruption."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from gpu_worker.checkpoints import format as checkpoint_format
from gpu_worker.checkpoints.format import Checkpoint, CheckpointMismatch, Snapshot
from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberResult
from services.errors import JobInterrupted
from services.models.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a running job writes a checkpoint: every so many steps, every so many
    seconds, whichever comes first; both 0 (the default) is never."""

    every_steps: int = 0  # 0: not by steps
    every_s: float = 0.0  # 0: not by time

    def __post_init__(self) -> None:
        if self.every_steps < 0 or not self.every_s >= 0:
            raise ValueError(f"a checkpoint policy needs every_steps, every_s >= 0, not {self}")

    @classmethod
    def of(cls, spec: ModelSpec) -> CheckpointPolicy:
        return cls(spec.checkpoint_every_steps, spec.checkpoint_every_s)

    def due(self, steps_since: int, seconds_since: float) -> bool:
        """Whether a checkpoint is due, ``steps_since`` steps and ``seconds_since``
        seconds after the last one (or the job's start or resume)."""
        by_steps = self.every_steps > 0 and steps_since >= self.every_steps
        by_time = self.every_s > 0 and seconds_since >= self.every_s
        return by_steps or by_time


@dataclass
class LoopState:
    """A diffusers member's denoising state on its device: what a snapshot holds."""

    latents: torch.Tensor
    scheduler: Any
    generators: list[torch.Generator]
    # Builds a fresh scheduler set to the job's steps, as ``scheduler`` was built.
    new_scheduler: Callable[[], Any]
    # A fresh scheduler: what a checkpoint need not hold. Built at the first
    # capture: building one costs about as much as the rest.
    baseline: Any = None
    # What else its remaining steps read (an edit's input latents, mask, first
    # noise), by name: kept in its checkpoints.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class MemberRun:
    """One member's place in its denoising loop."""

    member: BatchMember
    fingerprint: dict[str, Any]
    total: int  # steps of its loop: the scheduler's timesteps
    # The checkpoint it started from; None: step 0 (its checkpoint, handed back only if
    # it is suspended before a step, is made then: a torch.save per job otherwise).
    start: Checkpoint | None = None
    state: LoopState | None = None  # None: its step is its whole state (the sim family)
    step: int = 0  # steps done
    # The last checkpoint (or the start): the policy counts steps and seconds from it.
    marked_step: int = 0
    marked_at: float = 0.0
    result: MemberResult | None = None

    @classmethod
    def fresh(cls, member: BatchMember, scheduler: str, total: int, state: LoopState | None = None) -> Self:
        """The member at step 0, under the fingerprint of its request and ``scheduler``
        (a noise scheduler's class name; the registry's for a sim model)."""
        fingerprint = checkpoint_format.fingerprint(member.params, scheduler)
        return cls(member, fingerprint, total, state=state)

    def started_from(self) -> Checkpoint:
        """Where it started: handed back if it is suspended before a step."""
        if self.start is None:
            return checkpoint_format.capture(0, self.total, self.fingerprint, None)
        return self.start


class Resumption(enum.Enum):
    """What came back of the checkpoint a member was given."""

    LATENTS = "latents"  # its denoising state: it continues from there
    STEP = "step"  # its step alone (a sim member, or step 0): it draws its noise as a fresh one does
    REFUSED = "refused"  # nothing: it runs from step 0, its state built afresh


class MemberCheckpoints:
    """The checkpoints of one batch's members, on one device, by one policy."""

    def __init__(self, device: torch.device, policy: CheckpointPolicy) -> None:
        self.device = device
        self.policy = policy

    def resume(
        self, run: MemberRun, given: Checkpoint, latents: tuple[tuple[int, ...], torch.dtype] | None = None
    ) -> Resumption:
        """Puts ``run`` (fresh, at step 0) at ``given``'s step; ``latents`` is the
        shape and dtype its latents must have. On REFUSED the run's state may have
        been changed before the checkpoint was found unfit."""
        try:
            return self._restore(run, given, latents)
        except CheckpointMismatch as exc:
            # Not an error of the job: from step 0 it still gets its image, only later.
            log.warning(
                "a %s job cannot resume from its checkpoint of step %d; it runs from step 0: %s",
                run.member.params.model,
                given.step,
                exc,
            )
            run.step = 0
            return Resumption.REFUSED

    def _restore(
        self, run: MemberRun, given: Checkpoint, latents: tuple[tuple[int, ...], torch.dtype] | None
    ) -> Resumption:
        snapshot = checkpoint_format.restore(given, run.fingerprint, self.device)
        if given.total != run.total:
            raise CheckpointMismatch(f"the checkpoint is of {given.total} steps; this scheduler takes {run.total}")
        state = run.state
        if state is None:
            run.step, run.start = given.step, given
            return Resumption.STEP
        if snapshot is None:
            if given.step:
                raise CheckpointMismatch(f"the checkpoint of step {given.step} holds no denoising state")
            run.start = given
            return Resumption.STEP
        self._check_snapshot(snapshot, state, latents)
        try:
            for generator, generator_state in zip(state.generators, snapshot.generators, strict=True):
                generator.set_state(generator_state)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointMismatch(f"the checkpoint's generator state does not fit: {exc}") from None
        checkpoint_format.apply_scheduler_state(state.scheduler, snapshot.scheduler, snapshot.removed)
        state.latents = snapshot.latents
        state.extras = dict(snapshot.extras)
        run.step, run.start = given.step, given
        return Resumption.LATENTS

    def _check_snapshot(
        self, snapshot: Snapshot, state: LoopState, latents: tuple[tuple[int, ...], torch.dtype] | None
    ) -> None:
        if snapshot.device_type != self.device.type:
            # Generator states (and the arithmetic) differ by kind of device.
            raise CheckpointMismatch(f"the checkpoint was taken on {snapshot.device_type}, not {self.device.type}")
        found = (tuple(snapshot.latents.shape), snapshot.latents.dtype)
        if latents is not None and found != latents:
            raise CheckpointMismatch(
                f"the checkpoint's latents are {found[0]} {found[1]}, not {latents[0]} {latents[1]}"
            )
        if len(snapshot.generators) != len(state.generators):
            raise CheckpointMismatch(f"the checkpoint holds {len(snapshot.generators)} generators")

    def capture(self, run: MemberRun) -> Checkpoint:
        """The run's checkpoint now, at a step boundary."""
        state = run.state
        if state is None:
            return checkpoint_format.capture(run.step, run.total, run.fingerprint, None)
        if state.baseline is None:
            state.baseline = state.new_scheduler()
        changed, removed = checkpoint_format.scheduler_state(state.scheduler, state.baseline)
        generators = [g.get_state() for g in state.generators]
        snapshot = Snapshot(state.latents, generators, changed, removed, self.device.type, dict(state.extras))
        return checkpoint_format.capture(run.step, run.total, run.fingerprint, snapshot)

    def stopped(self, run: MemberRun) -> JobInterrupted:
        """What a member whose ``stopping`` is set leaves with, at a step boundary."""
        model = run.member.params.model
        try:
            if not run.member.suspend():
                return JobInterrupted(model)
            # No step ran here: the state is the one it started from.
            started = run.start.step if run.start is not None else 0
            return JobSuspended(model, run.started_from() if run.step == started else self.capture(run))
        except Exception:
            # The job still stops; it reruns from its last checkpoint, or step 0.
            log.exception("a %s job could not be suspended at step %d; it is interrupted", model, run.step)
            return JobInterrupted(model)

    @staticmethod
    def mark(runs: Sequence[MemberRun]) -> None:
        """The loop begins: the policy counts from here."""
        now = time.monotonic()
        for run in runs:
            run.marked_step, run.marked_at = run.step, now

    def stepped(self, run: MemberRun) -> None:
        """After a step: the member's periodic checkpoint, if the policy says so.
        None after the last step: the result follows at once."""
        if run.member.on_checkpoint is None or run.step >= run.total:
            return
        now = time.monotonic()
        if not self.policy.due(run.step - run.marked_step, now - run.marked_at):
            return
        run.marked_step, run.marked_at = run.step, now
        try:
            run.member.on_checkpoint(self.capture(run))
        except Exception:
            # A checkpoint only saves time on a resume: failing one never fails the job.
            log.exception("a %s job's checkpoint at step %d was not taken", run.member.params.model, run.step)
