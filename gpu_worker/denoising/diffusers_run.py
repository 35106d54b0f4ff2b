"""A member's run in the denoising loop of the diffusers families
(``gpu_worker.denoising.diffusers_denoiser``), and what the loop's parts use of the
denoiser that runs it: how one step calls the network (``NetworkStep``, for
``step_groups``), and whole generations off any job (``WarmUpDenoiser``, for the
warm-up in ``network_calls``). They depend on these, never on the loop itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gpu_worker.denoising.checkpoint_capture import MemberCheckpoints, MemberRun
from gpu_worker.denoising.members import BatchMember, MemberInputs
from gpu_worker.denoising.prompts import Conditioning
from services.generation import GenerationParams
from services.models.spec import ModelSpec


@dataclass
class DiffusersRun(MemberRun):
    """A diffusers member's place in its loop, with its prompt's conditioning."""

    conditioning: Conditioning = field(default_factory=Conditioning.empty)
    # Its scheduler's timesteps and its guidance scale on the device, for a network
    # call it shares with members at other steps or of other guidance: copied once.
    network_timesteps: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    network_guidance: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    # Its adapters' keys and scales, resident in the network's slots while it runs.
    adapters: tuple[tuple[str, float], ...] = ()


class NetworkStep(Protocol):
    """What one step's network call (``step_groups.guided_noise``) asks of a
    diffusers family's denoiser (``DiffusersDenoiser``)."""

    # Whether a guided step's halves (its prompt's and its negative prompt's) share
    # one network call, its rows doubled, or take one each.
    halves_share_call: bool

    def model_input(self, run: DiffusersRun, latents: torch.Tensor) -> torch.Tensor:
        """What the network takes for a member's (scaled) latents."""
        ...

    def classifier_free(self, params: GenerationParams) -> bool:
        """Whether a member's step calls the network twice, with its prompt and without."""
        ...

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        """The network's noise prediction for the rows ``x`` of ``runs``."""
        ...

    def combine_guidance(
        self, pipe: Any, uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """The guided prediction from the negative prompt's and the prompt's, each row by its scale."""
        ...


class WarmUpDenoiser(Protocol):
    """What the warm-up of a compiled network (``network_calls.warm_up_buckets``)
    runs of a diffusers family's denoiser (``DiffusersDenoiser``): whole
    generations, off any job."""

    @property
    def device(self) -> torch.device: ...

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        """What a warm-up generation takes besides its prompt (an upscaler: an input image)."""
        ...

    def warm_up_prompts(self, params: GenerationParams) -> list[str]:
        """The prompts the network is warmed up with for ``params``' bucket and guidance."""
        ...

    def led_inputs(
        self, pipe: Any, spec: ModelSpec, params: GenerationParams, inputs: MemberInputs | None
    ) -> MemberInputs | None:
        """``inputs`` with the leader's conditioning where a group's followers load no text encoder."""
        ...

    def denoise(
        self, pipe: Any, spec: ModelSpec, members: Sequence[BatchMember], checkpoints: MemberCheckpoints
    ) -> list[DiffusersRun]:
        """The members prepared and stepped to their ends, their latents left on the device."""
        ...
