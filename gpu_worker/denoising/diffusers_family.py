"""What a diffusers family says, and what the loop (``diffusers_denoiser``) asks of it:
its pipeline's parts and network, the shape and dtype of its latents, how a member
starts (its noise drawn, an edit's input noised to its first step), how one step's
network call is made and its guided halves combined, and its prompts' conditioning:
encoded where its text encoders are (the device, the host) or handed over by the
decoder service that serves them, and kept in the prompt cache. Each family in
``gpu_worker.families`` overrides what differs. A few lines over 300: one class, every
hook a family may override in one place."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gpu_worker.adapters.library import AdapterLibrary, slots_of
from gpu_worker.denoising.checkpoint_capture import LoopState, MemberRun
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.group_mesh import GroupMesh
from gpu_worker.denoising.lockstep import ALONE, Lockstep
from gpu_worker.denoising.members import BatchMember, MemberInputs
from gpu_worker.denoising.noise_schedulers import HOST, initial_sigma, start_from_input
from gpu_worker.denoising.prompts import Conditioning, PromptCache, prompt_key
from services.errors import DarkroomError
from services.generation import GenerationParams
from services.models import loader, speed
from services.models.adapters.lora_files import AdapterError
from services.models.compile_cache import CompileCache
from services.models.device import module_dtype
from services.models.spec import ModelSpec


class ConditioningNotServed(DarkroomError):
    """A job of a model whose text encoders are the decoder service's reached the loop
    without the conditioning a decoder encoded for it."""


class DiffusersFamily:
    """A family of diffusers pipelines whose denoising network is ``network_name``."""

    loads_weights = True
    takes_joiners = True  # a running batch takes jobs in at its step boundaries
    reads_prompts = True
    network_name = "unet"
    # Its other denoising networks, where a pipeline may hold more than one (Wan 2.2's
    # second expert): split across a group and sped up as the first.
    more_network_names: tuple[str, ...] = ()
    halves_share_call = True  # a guided step: one call, its rows doubled

    def __init__(
        self, models_dir: Path, device: torch.device, prompts: PromptCache, adapters: AdapterLibrary | None = None
    ) -> None:
        self.models_dir = models_dir
        self.device = device
        self.prompts = prompts
        self.adapters = adapters if adapters is not None else AdapterLibrary()
        # Batches are fused into one network call on an accelerator. The meta device
        # stands for one in a test, and has no generators: its noise comes from the CPU.
        self.fuse_batches = device.type != "cpu"
        self.generator_device = HOST if device.type == "meta" else device
        # The fleet's compiled artifacts (the engine's; None: inductor's own cache alone).
        self.compile_cache: CompileCache | None = None
        # A group's sampler: its parallel models split over the group's ranks, their
        # boundaries decided by the leader (``gpu_worker.group``).
        self.group: GroupMesh | None = None
        self.lockstep: Lockstep = ALONE
        # A group's follower: its leader encodes the prompts of the models it spans and
        # sends each member's conditioning, so it loads no text encoder of theirs.
        self.text_from_leader = False

    # -- what a family says --------------------------------------------------------

    def pipeline_parts(self, spec: ModelSpec) -> dict[str, Any]:
        """Components to load as given rather than from the model: the VAE lives in
        its own service, so the sampler never loads it."""
        return {"vae": None}

    def latent_shape(self, pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        scale = pipe.vae_scale_factor
        return (params.num_images, self.network(pipe).config.in_channels, params.height // scale, params.width // scale)

    def encode_prompt(self, pipe: Any, spec: ModelSpec, params: GenerationParams, cfg: bool) -> Conditioning:
        return Conditioning.encode(pipe, spec.family, params, self.text_device(pipe), cfg)

    def image_tokens(self, pipe: Any, params: GenerationParams) -> int:
        """The tokens its network sees of a job's latents (what a sequence split shares
        out): a transformer family's; 0 for the rest, which split no sequence."""
        return 0

    def classifier_free(self, params: GenerationParams) -> bool:
        """Whether a member's step calls the network twice (its rows doubled), with its
        prompt and without, mixed by its guidance scale."""
        return params.guidance_scale > 1.0

    def combine_guidance(
        self, pipe: Any, uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """A guided step's prediction from its negative prompt's and its prompt's:
        classifier-free guidance's line through them, ``scale`` along it (per row)."""
        return uncond + scale * (cond - uncond)

    def latent_dtype(self, pipe: Any) -> torch.dtype:
        """What a member's latents are kept in through its steps: the network's, unless
        its pipeline keeps them in float32 (Z-Image)."""
        return module_dtype(self.network(pipe))

    def timestep_args(self, pipe: Any, params: GenerationParams) -> dict[str, Any]:
        """What besides the steps sets a job's noise-scheduler timesteps (a shift by size)."""
        return {}

    def output_latents(self, pipe: Any, params: GenerationParams, latents: torch.Tensor) -> torch.Tensor:
        """A member's latents as its VAE decodes them, (N, C, H/8, W/8): Flux's are packed."""
        return latents

    def model_input(self, run: DiffusersRun, latents: torch.Tensor) -> torch.Tensor:
        """What the network takes for a member's (scaled) latents."""
        return latents

    def step_phase(self, pipe: Any, run: MemberRun) -> int:
        """Which of its networks computes ``run``'s step (step caching reuses within one)."""
        return 0

    def call_key(self, pipe: Any, run: DiffusersRun) -> Any:
        """What members that share a network call agree on besides their guidance mode
        (members of a batch have one size): an edit's input image's token grid, the
        network of their step (Wan 2.2's expert)."""
        return None

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        return pipe.unet(
            x, t, encoder_hidden_states=c.embeds, added_cond_kwargs=c.added_cond_kwargs(), return_dict=False
        )[0]

    def start(self, pipe: Any, run: DiffusersRun, member: BatchMember) -> None:
        """A fresh member's state at its first step: its noise drawn, and an edit's
        input noised to the step its strength starts at."""
        state = _state(run)
        noise = self.draw_noise(pipe, member.params, state)
        inputs = member.inputs
        if inputs is None or inputs.image_latents is None:
            state.latents = noise * initial_sigma(state.scheduler)
            return
        params = member.params
        image = inputs.image_latents.to(self.device, noise.dtype).repeat(params.num_images, 1, 1, 1)
        mask = inputs.mask.to(self.device, noise.dtype) if inputs.mask is not None else None
        image = self.in_latent_layout(pipe, params, image)
        mask = self.in_latent_layout(pipe, params, mask) if mask is not None else None
        run.step = start_from_input(state, params, image, mask, noise)

    def in_latent_layout(self, pipe: Any, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
        """An edit's input latents or mask, (N, C or 1, H/8, W/8), laid out as the
        member's latents are (Flux packs them)."""
        return x

    # -- its pipeline and its prompts --------------------------------------------

    def hold_adapters(self, pipe: Any, spec: ModelSpec, params: GenerationParams) -> tuple[tuple[str, float], ...]:
        """The job's adapters resident in the network's slots (loaded if not) and held
        there until its batch ends: each one's key and scale."""
        if not params.adapters:
            return ()
        slots = slots_of(pipe)
        if slots is None:
            raise AdapterError(f"model {spec.name!r} takes no adapters")
        held: list[str] = []
        try:
            for use in params.adapters:  # each held as it loads: the next cannot evict it
                if not slots.holds(use.key):
                    began = time.perf_counter()
                    slots.load(use.key, self.adapters.weights(use, spec.family))
                    self.adapters.loaded(time.perf_counter() - began)
                slots.hold([use.key])
                held.append(use.key)
        except BaseException:
            slots.release(held)
            raise
        return tuple((use.key, use.scale) for use in params.adapters)

    def network(self, pipe: Any) -> Any:
        return getattr(pipe, self.network_name)

    def networks(self, pipe: Any) -> list[Any]:
        """Every denoising network ``pipe`` holds: its first, and its others'."""
        found = (getattr(pipe, name, None) for name in (self.network_name, *self.more_network_names))
        return [network for network in found if network is not None]

    def prepare_network(self, pipe: Any, spec: ModelSpec, options: speed.SpeedOptions) -> None:
        """Its denoising networks with the model's speed options applied."""
        for name in (self.network_name, *self.more_network_names):
            if getattr(pipe, name, None) is not None:
                setattr(pipe, name, speed.prepare(getattr(pipe, name), options))

    def _max_rows(self, spec: ModelSpec) -> int:
        """The most rows one network call takes (before guidance doubles them): a
        batch's images where batches are fused, one member's elsewhere."""
        return spec.max_batch if self.fuse_batches else min(spec.max_images, spec.max_batch)

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        return None  # an upscaler's: its input

    def warm_up_prompts(self, params: GenerationParams) -> list[str]:
        """One: the network's shapes do not depend on the prompt (its text is padded)."""
        return [params.prompt]

    def encode_prompts(
        self,
        pipe: Any,
        spec: ModelSpec,
        batch: Sequence[GenerationParams],
        images: Mapping[str, MemberInputs] | None = None,
    ) -> None:
        if spec.text_encoders == "service":
            return  # nothing to encode here: the loop takes each member's own conditioning
        for params in batch:
            self.encode_cached(pipe, spec, params, (images or {}).get(params.image_digest))

    def encode_cached(
        self, pipe: Any, spec: ModelSpec, params: GenerationParams, inputs: MemberInputs | None = None
    ) -> Conditioning:
        """The job's prompt conditioning, from the prompt cache or encoded into it;
        ``inputs`` for a family whose text encoder sees the input image."""
        cfg = self.classifier_free(params)

        def encode() -> Conditioning:
            # Encoded where the text encoders are; kept where the network reads it.
            return self.conditioning(pipe, spec, params, cfg, inputs).to(self.device)

        with torch.inference_mode():
            return self.prompts.get(self.conditioning_key(params, cfg), encode)

    def conditioning_key(self, params: GenerationParams, cfg: bool) -> tuple[Any, ...]:
        """What the job's conditioning is cached under."""
        return prompt_key(params, cfg)

    def conditioning(
        self, pipe: Any, spec: ModelSpec, params: GenerationParams, cfg: bool, inputs: MemberInputs | None
    ) -> Conditioning:
        """The job's conditioning from its model's text encoders: here (``encode_prompt``),
        or, where they are the decoder service's, the one a decoder encoded for it."""
        if spec.text_encoders != "service" and not self.text_elsewhere(spec):
            return self.encode_prompt(pipe, spec, params, cfg)
        if inputs is None or inputs.conditioning is None:
            whose = "the decoder service's" if spec.text_encoders == "service" else "its group leader's"
            raise ConditioningNotServed(
                f"{params.model}'s text encoders are {whose}, and no conditioning came for this job"
            )
        # In the dtype its own encoders would have given (a decoder on a CPU encodes in float32).
        dtype = loader.compute_dtype(spec, self.device)
        tensors = inputs.conditioning.tensors().items()
        return Conditioning.of({k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors})

    def text_elsewhere(self, spec: ModelSpec) -> bool:
        """Whether ``spec``'s prompts are encoded elsewhere than here: by the decoder
        service, or (a follower) by its leader (``leader_encodes``)."""
        return spec.text_encoders == "service" or (self.text_from_leader and self.leader_encodes(spec))

    def leader_encodes(self, spec: ModelSpec) -> bool:
        """Whether a group's leader encodes the prompts of ``spec`` for its followers:
        a model it spans, unless the decoder service encodes them."""
        spans = self.group is not None and self.group.serves(spec.parallel)
        return spans and spec.text_encoders != "service"

    def led_inputs(
        self, pipe: Any, spec: ModelSpec, params: GenerationParams, inputs: MemberInputs | None
    ) -> MemberInputs | None:
        """A generation's ``inputs`` off any job (a compilation's warm-up, which every
        rank runs alike, in the same order) with its conditioning where the leader
        encodes for its followers: encoded on the leader, sent, and taken by each
        follower."""
        if not self.leader_encodes(spec):
            return inputs

        def encoded() -> Conditioning:
            return self.encode_cached(pipe, spec, params, inputs).to(torch.device("cpu"))

        conditioning = self.lockstep.shared(encoded)
        if self.group is not None and self.group.leads:
            return inputs
        return replace(inputs or MemberInputs(), conditioning=conditioning)

    def text_device(self, pipe: Any) -> torch.device:
        """Where the pipeline's text encoders are: the device, or the host (``text_encoders``)."""
        encoder = getattr(pipe, "text_encoder", None)
        if not isinstance(encoder, torch.nn.Module):
            return self.device
        return next(encoder.parameters()).device

    def draw_noise(self, pipe: Any, params: GenerationParams, state: LoopState) -> torch.Tensor:
        """One draw per output from its own generator, as the diffusers pipelines do."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (1, *self.latent_shape(pipe, params)[1:])
        dtype = self.latent_dtype(pipe)
        return torch.cat([randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in state.generators])


def _state(run: MemberRun) -> LoopState:
    """A diffusers run's state: it always has one."""
    assert run.state is not None
    return run.state
