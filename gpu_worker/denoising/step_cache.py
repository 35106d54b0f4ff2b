"""Step caching, an opt-in speed option (the model's ``step_cache``, or
``optimize = "aggressive"``): a member's network call is skipped at a step where
its prediction is expected to have barely changed, and its last computed
prediction (the guided one: both halves of a classifier-free step are saved) is
given to its noise scheduler instead.

The estimate is TeaCache's idea, accumulated change against a threshold, taken
from the member's own predictions rather than from a network's first block: each
computed step measures how far the prediction moved since the computed step
before it (the relative L1 distance, per step between them, the largest over the
member's images), and a later step reuses the last prediction while that rate
times the steps since stays within the threshold. It needs no hook inside the
network, so it serves every family alike (the UNets, the transformers, video) and
leaves a compiled network's graphs as they are.

A step's prediction is reused only from its own network: where a model switches
networks between steps (Wan 2.2's two experts: its ``phase``), a member's first step
on the next computes, and its rate starts again there.

Each member decides alone, from its own predictions: a batch runs its network on
the rows of the members that compute, so a member's image never depends on what
it is batched with (on a CPU it is exactly its solo image), and joiners and
leavers change nothing. Its first two steps (no rate yet) and its last step always
compute. What it carries from step to step is in its loop state's ``extras``, so a
checkpoint holds it and a resumed member decides as it would have uninterrupted.

Deciding reads one number per member back from the device at each step: the one
place the loop waits for the device, and only where step caching is on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gpu_worker.denoising.checkpoint_capture import LoopState, MemberRun

# A member's carried state, in its loop state's extras (and so in its checkpoints).
PREDICTION = "step_cache.prediction"  # the last computed (guided) prediction
RATE = "step_cache.rate"  # how far the prediction moved per step, at the last computation
COMPUTED_AT = "step_cache.computed_at"  # the step of the last computation
CACHED = "step_cache.cached"  # steps that reused a prediction, so far
PHASE = "step_cache.phase"  # the phase (the network) of the last computation


def one_phase(run: MemberRun) -> int:
    return 0


@dataclass(frozen=True)
class StepCache:
    threshold: float  # the largest estimated change a reused prediction may stand for
    # Which network computes a run's step (Wan 2.2's expert); one for most models.
    phase: Callable[[MemberRun], int] = one_phase

    def reusing(self, runs: Sequence[MemberRun]) -> set[int]:
        """The runs (by identity) whose step reuses their last prediction."""
        candidates = [r for r in runs if r.step < r.total - 1 and RATE in _state(r).extras and self._same_phase(r)]
        if not candidates:
            return set()
        rates = torch.stack([_state(r).extras[RATE] for r in candidates]).tolist()  # one read back for all
        return {
            id(r)
            for r, rate in zip(candidates, rates, strict=True)
            if rate * (r.step - int(_state(r).extras[COMPUTED_AT])) <= self.threshold
        }

    def computed(self, run: MemberRun, prediction: torch.Tensor) -> None:
        """``run`` computed ``prediction`` at its step: the next decisions' rate (none
        yet at its first step of a phase)."""
        extras = _state(run).extras
        last = extras.get(PREDICTION)
        if last is not None and self._same_phase(run):
            steps = run.step - int(extras[COMPUTED_AT])
            extras[RATE] = relative_change(prediction, last) / steps
        else:
            extras.pop(RATE, None)
        extras[PREDICTION] = prediction
        extras[COMPUTED_AT] = torch.tensor(run.step)
        extras[PHASE] = torch.tensor(self.phase(run))

    def _same_phase(self, run: MemberRun) -> bool:
        """Whether ``run``'s step is of the phase of its last computation (a state
        from before phases were kept: yes)."""
        last = _state(run).extras.get(PHASE)
        return last is None or int(last) == self.phase(run)

    @staticmethod
    def reused(run: MemberRun) -> torch.Tensor:
        """The prediction ``run`` reuses at its step, counted."""
        extras = _state(run).extras
        extras[CACHED] = torch.tensor((cached_steps(run) or 0) + 1)
        return extras[PREDICTION]


def cached_steps(run: MemberRun) -> int | None:
    """Steps of ``run`` (resumed ones included) that reused a prediction; None
    where no step of it ran with step caching."""
    extras = run.state.extras if run.state is not None else {}
    if PREDICTION not in extras:
        return None
    return int(extras[CACHED]) if CACHED in extras else 0


def relative_change(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The relative L1 distance from ``before`` to ``now``, the largest over their
    rows (a member's images), on their device."""
    diff = (now.float() - before.float()).abs().flatten(1).mean(1)
    return (diff / before.float().abs().flatten(1).mean(1).clamp_min(1e-12)).max()


def _state(run: MemberRun) -> LoopState:
    assert run.state is not None
    return run.state
