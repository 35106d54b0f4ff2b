"""The sampler: text encoders + UNet + a noise scheduler, run step by step over a
batch of jobs.

Jobs with the same model, size, steps and guidance run as one batch. Each member
keeps its own noise (its seeds), its own noise-scheduler state, its own progress
and its own stop: a cancelled or timed-out member leaves at the next step and the
rest go on. On a GPU the members' UNet calls are fused into one; on a CPU each
member's call runs on its own rows, because CPU kernels block matrix products
differently for different batch sizes and only then is a batched image exactly the
one the job would get alone.

Runs in a worker thread (never on the event loop)."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_worker.prompts import Conditioning, PromptCache
from gpu_worker.residency import DoesNotFit, Resident, victims
from services.errors import DarkroomError, JobInterrupted, ModelError
from services.metrics import COLD_LOADS, MODEL_LOAD_SECONDS
from services.models import loader, sim
from services.models.registry import ModelRegistry, ModelSpec

log = logging.getLogger("darkroom.sampler")

WARM_UP_STEPS = 2
# On a GPU, memory kept free beyond the models, for activations.
ACTIVATION_HEADROOM = 0.15


class BadOutput(DarkroomError):
    """The sampler produced NaN, inf or a degenerate (near-constant) result."""


@dataclass(frozen=True)
class BatchKey:
    model: str
    width: int
    height: int
    steps: int
    guidance_scale: float


@dataclass(frozen=True)
class SampleRequest:
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    num_images: int

    @property
    def key(self) -> BatchKey:
        return BatchKey(self.model, self.width, self.height, self.steps, self.guidance_scale)


@dataclass(frozen=True)
class BatchMember:
    request: SampleRequest
    on_step: Callable[[int, int], None]  # (step done, total), from the sampling thread
    stopping: threading.Event  # set from any thread: leave the batch at the next step


@dataclass
class _Model:
    pipe: Any
    bytes: int
    load_s: float
    last_used: float
    pinned: bool


@dataclass
class _Run:
    """One member's state inside the denoising loop."""

    member: BatchMember
    conditioning: Conditioning
    latents: torch.Tensor
    scheduler: Any
    generators: list[torch.Generator]
    result: torch.Tensor | BaseException | None = None


def check_output(latents: torch.Tensor, min_std: float) -> None:
    """Raises BadOutput for latents no image should come from."""
    if not bool(torch.isfinite(latents).all()):
        raise BadOutput("the sampler produced NaN or infinite latents")
    for i, image in enumerate(latents):
        std = float(image.float().std())
        if std < min_std:
            raise BadOutput(f"image {i} is degenerate: latent standard deviation {std:.2e} < {min_std:.0e}")


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
    ) -> None:
        self.registry = registry
        self.models_dir = models_dir
        self.device = device
        # 0: the GPU's own memory (less headroom), unlimited on a CPU.
        self.memory_budget_bytes = memory_budget_bytes
        self.pinned = frozenset(pinned)
        self.prompts = PromptCache(prompt_cache_bytes)
        self.fuse_batches = device.type == "cuda"
        self._models: dict[str, _Model] = {}
        self._measured: dict[str, int] = {}  # bytes of each model loaded here, even if evicted since
        self._lock = threading.RLock()

    def dtype_for(self, spec: ModelSpec) -> torch.dtype:
        return loader.compute_dtype(spec, self.device)

    def warm_models(self) -> list[str]:
        return sorted(self._models)

    def footprints(self) -> dict[str, dict[str, float]]:
        """Measured bytes and load seconds of each loaded model, for the scheduler.
        Called from the event loop: it must not wait for the lock a load holds."""
        loaded = list(self._models.items())  # one step under the GIL, whatever a loading thread does
        return {name: {"bytes": m.bytes, "load_s": round(m.load_s, 3)} for name, m in loaded}

    # -- residency -------------------------------------------------------------

    def _free_bytes(self) -> int | None:
        """Bytes a new model may take now, or None for no limit."""
        used = sum(m.bytes for m in self._models.values())
        limits = []
        if self.memory_budget_bytes:
            limits.append(self.memory_budget_bytes - used)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            limits.append(free - int(total * ACTIVATION_HEADROOM))
        return min(limits) if limits else None

    def _make_room(self, name: str, need: int) -> None:
        """Evicts other models until ``need`` more bytes fit."""
        free = self._free_bytes()
        if free is None:
            return
        residents = [
            Resident(other, m.bytes, self.registry.get(other).eviction_priority, m.last_used, m.pinned)
            for other, m in self._models.items()
            if other != name
        ]
        try:
            chosen = victims(need, free, residents)
        except DoesNotFit as exc:
            raise ModelError(f"model {name!r} does not fit in this worker's memory: {exc}") from None
        for victim in chosen:
            log.info("evicting %s to make room for %s", victim, name)
            self._drop(victim)

    def load(self, name: str) -> Any:
        with self._lock:
            model = self._models.get(name)
            if model is not None:
                model.last_used = time.monotonic()
                return model.pipe
            spec = self.registry.get(name)
            if spec.family == "sim":
                # Nothing to load: a sim model only sleeps (services/models/sim.py).
                self._models[name] = _Model(spec, 0, 0.0, time.monotonic(), name in self.pinned)
                return spec
            from diffusers import DiffusionPipeline

            # Its measured size once it has been loaded here; the registry's before.
            self._make_room(name, self._measured.get(name, spec.vram_bytes))
            # The VAE lives in its own service; the sampler never loads it.
            kwargs: dict[str, Any] = {"vae": None}
            if spec.family in ("sd15", "tiny"):
                kwargs.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
            loaded = loader.load(
                DiffusionPipeline, spec, self.models_dir, self.device, dtype=self.dtype_for(spec), **kwargs
            )
            pipe = loaded.value
            pipe.set_progress_bar_config(disable=True)
            self._apply_speed_options(pipe, spec)
            self._models[name] = _Model(pipe, loaded.bytes, loaded.seconds, time.monotonic(), name in self.pinned)
            MODEL_LOAD_SECONDS.labels(model=name).observe(loaded.seconds)
            self._measured[name] = loaded.bytes
            # Bigger than the registry said: others make room now, not at the next load.
            self._make_room(name, 0)
            log.info("loaded %s on %s in %.2fs (%.0f MiB)", name, self.device, loaded.seconds, loaded.bytes / 2**20)
            return pipe

    def _apply_speed_options(self, pipe: Any, spec: ModelSpec) -> None:
        if spec.attention:
            from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

            pipe.unet.set_attn_processor(AttnProcessor2_0() if spec.attention == "sdpa" else AttnProcessor())
        if self.device.type != "cuda":
            return  # channels-last and compilation pay off on a GPU only
        if spec.channels_last:
            pipe.unet.to(memory_format=torch.channels_last)
        if spec.compile:
            pipe.unet = torch.compile(pipe.unet, fullgraph=True)

    def unload(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def _drop(self, name: str) -> None:
        model = self._models.pop(name, None)
        if model is None:
            return
        self.prompts.forget(name)
        del model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("dropped %s", name)

    def warm_up(self, name: str) -> float:
        """Loads ``name`` and runs one real generation, so the first job finds its
        kernels compiled and caches filled. Returns the generation's seconds."""
        spec = self.registry.get(name)
        request = SampleRequest(name, "warm-up", "", spec.default_width, spec.default_height, WARM_UP_STEPS, 7.5, 0, 1)
        started = time.perf_counter()
        [result] = self.sample_batch([BatchMember(request, lambda step, total: None, threading.Event())])
        if isinstance(result, BaseException):
            raise result
        return time.perf_counter() - started

    # -- sampling --------------------------------------------------------------

    def sample(
        self, req: SampleRequest, on_step: Callable[[int, int], None], stopping: threading.Event
    ) -> torch.Tensor:
        """One job alone: its latents, or the exception that ended it."""
        [result] = self.sample_batch([BatchMember(req, on_step, stopping)])
        if isinstance(result, BaseException):
            raise result
        return result

    def sample_batch(self, members: Sequence[BatchMember]) -> list[torch.Tensor | BaseException]:
        """Runs the members' denoising loops together. Returns, per member, its
        latents (num_images, C, H/8, W/8) on the CPU, or what ended it: JobInterrupted
        once its ``stopping`` was set, BadOutput, or the error of its own inputs.
        An error of the batch as a whole (the model, the device) is raised."""
        keys = {m.request.key for m in members}
        if len(keys) != 1:
            raise ValueError(f"a batch holds jobs of one shape, not {len(keys)}")
        key = keys.pop()
        spec = self.registry.get(key.model)
        if key.model not in self._models:  # a job waits for this load
            COLD_LOADS.labels(model=key.model).inc()
        pipe = self.load(key.model)
        if spec.family == "sim":
            return self._simulate(spec, key, members)
        with torch.inference_mode():
            runs = [self._prepare(pipe, spec, m) for m in members]
            self._denoise(pipe, key, [r for r in runs if r.result is None])
        for run in runs:
            if run.result is None:
                try:
                    check_output(run.latents, spec.min_output_std)
                    run.result = run.latents.to("cpu", torch.float32)
                except BadOutput as exc:
                    run.result = exc
        return [r.result if r.result is not None else RuntimeError("no result") for r in runs]

    def _simulate(
        self, spec: ModelSpec, key: BatchKey, members: Sequence[BatchMember]
    ) -> list[torch.Tensor | BaseException]:
        """A sim model's batch: the modelled time per step, then latents from each job's seeds."""
        finished = sim.sleep_steps(
            spec,
            key.width,
            key.height,
            key.steps,
            [m.stopping for m in members],
            lambda i, step, total: members[i].on_step(step, total),
        )
        return [
            sim.latents(m.request) if done else JobInterrupted(key.model)
            for m, done in zip(members, finished, strict=True)
        ]

    def _prepare(self, pipe: Any, spec: ModelSpec, member: BatchMember) -> _Run:
        req = member.request
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(req.steps, device=self.device)
        generators = [
            torch.Generator(device=self.device).manual_seed((req.seed + i) % 2**63) for i in range(req.num_images)
        ]
        run = _Run(member, Conditioning.empty(), torch.empty(0), scheduler, generators)
        if member.stopping.is_set():
            run.result = JobInterrupted(req.model)
            return run
        try:
            cfg = req.guidance_scale > 1.0
            run.conditioning = self.prompts.get(
                (req.model, req.prompt, req.negative_prompt, cfg, req.width, req.height),
                lambda: Conditioning.encode(pipe, spec.family, req, self.device, cfg),
            )
            from diffusers.utils.torch_utils import randn_tensor

            shape = (
                1,
                pipe.unet.config.in_channels,
                req.height // pipe.vae_scale_factor,
                req.width // pipe.vae_scale_factor,
            )
            dtype = pipe.unet.dtype
            # One draw per image from its own generator, as the diffusers pipelines do.
            noise = [randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in generators]
            run.latents = torch.cat(noise) * scheduler.init_noise_sigma
        except Exception as exc:  # this member's inputs: it fails alone
            run.result = exc
        return run

    def _denoise(self, pipe: Any, key: BatchKey, runs: list[_Run]) -> None:
        if not runs:
            return
        timesteps = runs[0].scheduler.timesteps
        takes_generator = "generator" in inspect.signature(runs[0].scheduler.step).parameters
        cfg = key.guidance_scale > 1.0
        for index, t in enumerate(timesteps):
            active = [r for r in runs if r.result is None]
            for r in active:
                if r.member.stopping.is_set():
                    r.result = JobInterrupted(key.model)
            active = [r for r in active if r.result is None]
            if not active:
                return
            groups = [active] if self.fuse_batches else [[r] for r in active]
            for group in groups:
                noise = self._predict(pipe, group, t, cfg, key.guidance_scale)
                for r, eps in zip(group, noise, strict=True):
                    extra = {"generator": r.generators} if takes_generator else {}
                    r.latents = r.scheduler.step(eps, t, r.latents, **extra, return_dict=False)[0]
            for r in active:
                r.member.on_step(index + 1, len(timesteps))

    def _predict(self, pipe: Any, group: list[_Run], t: torch.Tensor, cfg: bool, guidance: float) -> list[torch.Tensor]:
        """The guided noise prediction of each run in ``group``, from one UNet call."""
        scaled = [r.scheduler.scale_model_input(r.latents, t) for r in group]
        sizes = [s.shape[0] for s in scaled]
        x = torch.cat(scaled)
        c = Conditioning.stack([r.conditioning.rows(r.latents.shape[0]) for r in group])
        if cfg:
            x = torch.cat([x, x])
            c = Conditioning.stack([c.negative(), c])
        out = pipe.unet(
            x,
            t,
            encoder_hidden_states=c.embeds,
            added_cond_kwargs=c.added_cond_kwargs(),
            return_dict=False,
        )[0]
        if cfg:
            uncond, cond = out.chunk(2)
            out = uncond + guidance * (cond - uncond)
        return list(out.split(sizes))
