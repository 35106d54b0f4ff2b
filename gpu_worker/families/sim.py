"""The sim family (``services.models.sim``): a batch that only sleeps the modelled
time of each step, then returns latents drawn from each job's seeds. Its step is a
member's whole state, so its checkpoints hold the step alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpu_worker.denoising.checkpoint_capture import MemberCheckpoints, MemberRun
from gpu_worker.denoising.members import BatchMember, MemberInputs, MemberResult
from gpu_worker.denoising.running_batch import BatchJoins
from services.generation import GenerationParams
from services.models import sim
from services.models.loader import Loaded
from services.models.spec import ModelSpec


class SimDenoiser:
    loads_weights = False
    takes_joiners = False  # a batch sleeps its steps in one call
    reads_prompts = False

    def load(self, spec: ModelSpec) -> Loaded:
        return Loaded(spec, 0, 0.0)  # nothing to load: a sim model only sleeps

    def encode_prompts(
        self,
        model: Any,
        spec: ModelSpec,
        batch: Sequence[GenerationParams],
        images: Mapping[str, MemberInputs] | None = None,
    ) -> None:
        pass  # a sim model reads no prompt

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        return None

    def sample(
        self,
        model: Any,
        spec: ModelSpec,
        members: Sequence[BatchMember],
        checkpoints: MemberCheckpoints,
        joins: BatchJoins | None = None,
    ) -> list[MemberResult]:
        if joins is not None:
            raise ValueError("a sim batch takes no joiners")
        key = members[0].params.key
        runs = [MemberRun.fresh(m, spec.scheduler, key.steps) for m in members]
        for run in runs:
            if run.member.resume is not None:
                checkpoints.resume(run, run.member.resume)
        checkpoints.mark(runs)

        def on_step(i: int, step: int, total: int) -> None:
            runs[i].step = step
            members[i].on_step(step, total)
            checkpoints.stepped(runs[i])

        stopping = [m.stopping for m in members]
        finished = sim.sleep_steps(spec, key.width, key.height, key.steps, stopping, on_step, [r.step for r in runs])
        return [
            sim.latents(r.member.params, spec.sim_image) if done else checkpoints.stopped(r)
            for r, done in zip(runs, finished, strict=True)
        ]
