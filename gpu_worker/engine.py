"""The sampler's engine: runs a batch of jobs of one batch key through their model
family's ``Denoiser``, the model taken from the ``ModelCache`` (loaded, and others
evicted, when it is not held), each member's checkpoints by the model's policy.

Runs in a worker thread (never on the event loop)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gpu_worker.adapters.library import AdapterLibrary, slots_of
from gpu_worker.busy import BusyClock
from gpu_worker.denoising.checkpoint_capture import CheckpointPolicy, MemberCheckpoints
from gpu_worker.denoising.denoiser import Denoiser
from gpu_worker.denoising.diffusers_family import DiffusersFamily
from gpu_worker.denoising.members import BatchMember, MemberInputs, MemberResult
from gpu_worker.denoising.prompts import PromptCache
from gpu_worker.denoising.running_batch import BatchJoins
from gpu_worker.families.flux import FluxDenoiser, FluxKontextDenoiser
from gpu_worker.families.qwen_image import QwenImageDenoiser, QwenImageEditDenoiser
from gpu_worker.families.sd3 import SD3Denoiser
from gpu_worker.families.sim import SimDenoiser
from gpu_worker.families.unet import UNetDenoiser
from gpu_worker.families.upscale import UpscaleDenoiser
from gpu_worker.families.wan import WanDenoiser
from gpu_worker.families.z_image import ZImageDenoiser
from gpu_worker.metrics import COLD_LOADS
from gpu_worker.models.model_cache import ModelCache
from services.generation import GenerationParams
from services.models.compile_cache import CompileCache
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily, ModelSpec

WARM_UP_STEPS = 2


def batch_model(members: Sequence[BatchMember]) -> str:
    """The model of a batch, whose members are of one join key (model and size)."""
    keys = {m.params.join_key for m in members}
    if len(keys) != 1:
        raise ValueError(f"a batch holds jobs of one model and size, not {len(keys)}")
    return keys.pop().model


class SamplerEngine:
    def __init__(
        self,
        registry: ModelRegistry,
        models_dir: Path,
        device: torch.device,
        *,
        memory_budget_bytes: int = 0,
        prompt_cache_bytes: int = 64 * 2**20,
        pinned: Sequence[str] = (),
        capabilities: Collection[str] = (),
        shares_device: bool = False,
        adapters: AdapterLibrary | None = None,
        compile_cache: CompileCache | None = None,
    ) -> None:
        self.registry = registry
        self.models_dir = models_dir
        self.device = device
        # The kinds of work an operator lets it serve (DARKROOM_CAPABILITIES); empty: all.
        self.capabilities = frozenset(capabilities)
        self.prompts = PromptCache(prompt_cache_bytes)
        self.busy = BusyClock()  # its batches' denoising, against the time work waited
        # Sharing its GPU with decodes (``decode_locally``: on a stream of the lowest
        # priority), it denoises on a stream of the highest: a decode takes what it leaves.
        prioritised = shares_device and device.type == "cuda"
        self._stream = torch.cuda.Stream(device, priority=-10) if prioritised else None
        # Where adapters' weights come from (the model store through the host cache).
        library = adapters if adapters is not None else AdapterLibrary()
        self.adapter_library = library
        unet = UNetDenoiser(models_dir, device, self.prompts, library)
        # One denoiser per model family.
        self.denoisers: dict[ModelFamily, Denoiser] = {
            ModelFamily.SD15: unet,
            ModelFamily.SDXL: unet,
            ModelFamily.TINY: unet,
            ModelFamily.WAN: WanDenoiser(models_dir, device, self.prompts, library),
            ModelFamily.SD_X4_UPSCALER: UpscaleDenoiser(models_dir, device, self.prompts, library),
            ModelFamily.SD3: SD3Denoiser(models_dir, device, self.prompts, library),
            ModelFamily.FLUX: FluxDenoiser(models_dir, device, self.prompts, library),
            ModelFamily.FLUX_KONTEXT: FluxKontextDenoiser(models_dir, device, self.prompts, library),
            ModelFamily.QWEN_IMAGE: QwenImageDenoiser(models_dir, device, self.prompts, library),
            ModelFamily.Z_IMAGE: ZImageDenoiser(models_dir, device, self.prompts, library),
            ModelFamily.QWEN_IMAGE_EDIT: QwenImageEditDenoiser(models_dir, device, self.prompts, library),
            ModelFamily.SIM: SimDenoiser(),
        }
        for denoiser in self.denoisers.values():
            if isinstance(denoiser, DiffusersFamily):
                denoiser.compile_cache = compile_cache
        self.models = ModelCache(
            registry,
            self.denoiser_for,
            device,
            memory_budget_bytes=memory_budget_bytes,
            pinned=pinned,
            on_drop=self.prompts.forget,  # a dropped model's conditioning goes with it
        )

    def denoiser_for(self, spec: ModelSpec) -> Denoiser:
        return self.denoisers[spec.family]

    def load(self, name: str) -> Any:
        return self.models.get(name)

    def unload(self, name: str) -> None:
        self.models.unload(name)

    def warm_models(self) -> list[str]:
        return self.models.warm_models()

    def mark_stale(self, names: Collection[str]) -> None:
        self.models.mark_stale(names)

    def served_models(self) -> list[str]:
        """The registry's models it serves: of the capabilities it is let serve, and
        small enough for its memory."""
        capacity = self.models.capacity_bytes()
        specs = [self.registry.get(name) for name in self.registry.names()]
        return [
            spec.name
            for spec in specs
            if (not self.capabilities or spec.capability in self.capabilities)
            and (capacity is None or spec.vram_bytes <= capacity)
            # A sharded model's vram_mb is a shard's: only a group that shards it holds it.
            and (spec.parallel.tensor == 1 or self.spans(spec.name))
        ]

    def spans(self, model: str) -> bool:
        """Whether a batch of ``model`` runs across a group here (a group's engine)."""
        return False

    def footprints(self) -> dict[str, dict[str, float]]:
        return self.models.footprints()

    def adapters(self) -> dict[str, Any]:
        """For its heartbeat: the adapters resident on its device, and what loading
        one has taken it (placement adds that for a job's adapters it lacks)."""
        resident = sorted({key for pipe in self.models.loaded() if (s := slots_of(pipe)) for key in s.resident})
        facts: dict[str, Any] = {"adapters": resident}
        if self.adapter_library.load_s is not None:
            facts["adapter_load_s"] = round(self.adapter_library.load_s, 4)
        return facts

    def devices_for(self, model: str) -> int:
        """The devices a batch of ``model`` runs on here: what its GPU-seconds count."""
        return 1

    def group_facts(self) -> dict[str, Any] | None:
        """Its group's, for its heartbeat; None for a sampler alone."""
        return None

    def classifier_free(self, params: GenerationParams) -> bool:
        """Whether the job's conditioning has its negative half (its family decides)."""
        denoiser = self.denoiser_for(self.registry.get(params.model))
        decides = getattr(denoiser, "classifier_free", None)
        return bool(decides(params)) if decides is not None else False

    def warm_up(self, name: str) -> float:
        """Loads ``name`` and runs one real generation, so the first job finds its
        kernels compiled and caches filled. Returns the generation's seconds. A model
        whose text encoders are the decoder service's is loaded alone: a generation
        needs a conditioning that only a decoder (on the event loop's side) makes."""
        spec = self.registry.get(name)
        if spec.text_encoders == "service":
            started = time.perf_counter()
            self.load(name)
            return time.perf_counter() - started
        params = GenerationParams(
            name,
            "warm-up",
            "",
            spec.default_width,
            spec.default_height,
            WARM_UP_STEPS,
            spec.default_guidance,
            0,
            1,
            frames=spec.default_frames,
            fps=spec.default_fps,
        )
        inputs = self.denoiser_for(spec).warm_up_inputs(spec, params)
        started = time.perf_counter()
        self.sample(params, lambda step, total: None, threading.Event(), inputs)
        return time.perf_counter() - started

    def sample(
        self,
        params: GenerationParams,
        on_step: Callable[[int, int], None],
        stopping: threading.Event,
        inputs: MemberInputs | None = None,
    ) -> torch.Tensor:
        """One job alone: its latents; raises what ended it."""
        [result] = self.sample_batch([BatchMember(params, on_step, stopping, inputs=inputs)])
        if isinstance(result, BaseException):
            raise result
        return result

    def takes_joiners(self, model: str) -> bool:
        """Whether a running batch of ``model`` takes jobs in at a step boundary: not
        once it is stale (its store version changed), so that its batch ends and the
        next loads it afresh."""
        return self.denoiser_for(self.registry.get(model)).takes_joiners and not self.models.is_stale(model)

    def sample_batch(
        self,
        members: Sequence[BatchMember],
        joins: BatchJoins | None = None,
        on_denoising: Callable[[], None] = lambda: None,
    ) -> list[MemberResult]:
        """Runs the members' denoising loops together, and those offered to ``joins``
        from their next step boundary on. Returns, per member (the joiners after the
        rest), its latents (num_images, C, H/8, W/8; a video's with its latent frames
        after C) on the CPU, or what ended it: JobSuspended or JobInterrupted once its
        ``stopping`` was set, BadOutput, or the error of its own inputs; with
        ``joins`` each also goes out as it leaves. An error of the batch as a whole
        (the model, the device) is raised. ``on_denoising``: called (in this thread)
        once the model is loaded, as its first step begins."""
        model = batch_model(members)
        if model not in self.models:  # a job waits for this load
            COLD_LOADS.labels(model=model).inc()
        with self._on_stream():
            return self._sample(self.models.get(model), members, joins, on_denoising)

    def _sample(
        self,
        loaded: Any,
        members: Sequence[BatchMember],
        joins: BatchJoins | None,
        on_denoising: Callable[[], None],
    ) -> list[MemberResult]:
        """The members denoised by the model ``loaded`` (their batch's)."""
        spec = self.registry.get(members[0].params.model)
        checkpoints = MemberCheckpoints(self.device, CheckpointPolicy.of(spec))
        with self.busy.denoising():
            on_denoising()
            return self.denoiser_for(spec).sample(loaded, spec, members, checkpoints, joins)

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Its device's work on its denoising stream (from whichever thread): the
        prompts encoded ahead are then ordered before the batch that reads them."""
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def encodes_prompts(self, model: str) -> bool:
        """Whether ``encode_prompts`` would encode anything for a batch of ``model``: it
        is loaded here, and its family reads prompts."""
        spec = self.registry.models.get(model)
        return spec is not None and model in self.models and self.denoiser_for(spec).reads_prompts

    def encode_prompts(
        self, batch: Sequence[GenerationParams], images: Mapping[str, MemberInputs] | None = None
    ) -> None:
        """Encodes the prompts of a batch that runs next into the prompt cache while
        the device runs the one before it, so that the batch starts at its first
        step. Only for a model already loaded (a load here would evict what runs)."""
        if not batch or not self.encodes_prompts(batch[0].model):
            return
        spec = self.registry.get(batch[0].model)
        with self._on_stream():
            self.denoiser_for(spec).encode_prompts(self.models.get(spec.name), spec, batch, images)
