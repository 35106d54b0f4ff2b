"""The seam between the sampler and a model family: the ``Denoiser`` a family
implements to run a batch of jobs (``gpu_worker.denoising.members``) through its
denoising loop (``gpu_worker.denoising.diffusers_denoiser``'s loop for the
diffusers families, ``gpu_worker.families.sim`` for sim). Denoisers run in a worker
thread, never on the event loop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gpu_worker.denoising.checkpoint_capture import MemberCheckpoints
from gpu_worker.denoising.members import BatchMember, MemberInputs, MemberResult
from gpu_worker.denoising.running_batch import BatchJoins
from gpu_worker.models.model_cache import ModelLoader
from services.generation import GenerationParams
from services.models.spec import ModelSpec


class Denoiser(ModelLoader, Protocol):
    """One model family: how its models load (``ModelLoader``), and how a batch runs
    through one."""

    def encode_prompts(
        self,
        model: Any,
        spec: ModelSpec,
        batch: Sequence[GenerationParams],
        images: Mapping[str, MemberInputs] | None = None,
    ) -> None:
        """Puts the batch's prompt conditioning where its ``sample`` will find it;
        ``images``, by digest: the input images of a family whose text encoder sees them."""
        ...

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        """What a warm-up generation takes besides its prompt (an upscaler: an input image)."""
        ...

    # Whether its loop takes members in from a ``RunningBatch`` at step boundaries.
    takes_joiners: bool
    # Whether its batches read their prompts (False: ``encode_prompts`` does nothing,
    # and no thread is asked to run it).
    reads_prompts: bool

    def sample(
        self,
        model: Any,
        spec: ModelSpec,
        members: Sequence[BatchMember],
        checkpoints: MemberCheckpoints,
        joins: BatchJoins | None = None,
    ) -> list[MemberResult]:
        """Runs the members (one join key) together, and those offered to ``joins``
        from the next step boundary on; per member, its latents or what ended it:
        JobSuspended or JobInterrupted once its ``stopping`` was set, BadOutput, or
        the error of its own inputs. An error of the batch as a whole (the model,
        the device) is raised."""
        ...
