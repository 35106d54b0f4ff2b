"""The sampler: text encoders + UNet + a noise scheduler, run step by step over a
batch of jobs.

Jobs with the same model, size, steps and guidance run as one batch. Each member
keeps its own noise (its seeds), its own noise-scheduler state, its own progress
and its own stop: a cancelled or timed-out member leaves at the next step and the
rest go on. On a GPU the UNet calls of the members at the same step are fused into
one; on a CPU each member's call runs on its own rows, because CPU kernels block
matrix products differently for different batch sizes and only then is a batched
image exactly the one the job would get alone.

A member may be suspended rather than stopped, and resumed later, anywhere: at a
step boundary its state is captured into a ``Checkpoint`` (gpu_worker/checkpoint.py),
and a member given one starts from its step, with its own step index, beside
members that start from 0. Resuming gives exactly the uninterrupted image on a CPU
(on a GPU, what rerunning the job would give there). Checkpoints may also be taken
every so many steps or seconds (the model's registry entry), handed to the member's
``on_checkpoint`` from this thread.

Runs in a worker thread (never on the event loop)."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu_worker import checkpoint
from gpu_worker.checkpoint import Checkpoint, CheckpointMismatch, CheckpointPolicy, Snapshot
from gpu_worker.metrics import COLD_LOADS, MODEL_LOAD_SECONDS
from gpu_worker.prompts import Conditioning, PromptCache
from gpu_worker.residency import DoesNotFit, Resident, victims
from services.errors import DarkroomError, JobInterrupted, ModelError
from services.models import loader, sim
from services.models.registry import ModelRegistry, ModelSpec, scheduler_class

log = logging.getLogger(__name__)

WARM_UP_STEPS = 2
# On a GPU, memory kept free beyond the models, for activations.
ACTIVATION_HEADROOM = 0.15


class BadOutput(DarkroomError):
    """The sampler produced NaN, inf or a degenerate (near-constant) result."""


class JobSuspended(JobInterrupted):
    """A member stopped at a step boundary whose ``checkpoint`` resumes it there."""

    def __init__(self, job: str, checkpoint: Checkpoint) -> None:
        super().__init__(job)
        self.job = job
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return f"{self.job} suspended at step {self.checkpoint.step}/{self.checkpoint.total}"


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


def _never() -> bool:
    return False


@dataclass(frozen=True)
class BatchMember:
    request: SampleRequest
    on_step: Callable[[int, int], None]  # (step done, total), from the sampling thread
    stopping: threading.Event  # set from any thread: leave the batch at the next step
    resume: Checkpoint | None = None  # start from this checkpoint's step
    # Periodic checkpoints (the model's policy), from the sampling thread: the batch
    # waits for it, so it should hand the bytes off, not store them.
    on_checkpoint: Callable[[Checkpoint], None] | None = None
    # Asked, from the sampling thread, once ``stopping`` is seen: True leaves with
    # JobSuspended and a checkpoint, False with JobInterrupted.
    suspend: Callable[[], bool] = _never


@dataclass
class _Model:
    pipe: Any
    bytes: int
    load_s: float
    last_used: float
    pinned: bool


@dataclass
class _Run:
    """One member's state inside the denoising loop (a sim member's: no scheduler,
    no latents; its step is all its state)."""

    member: BatchMember
    fingerprint: dict[str, Any]
    total: int  # steps of its loop: the scheduler's timesteps
    start: Checkpoint  # where it started: handed back if it is suspended before a step
    conditioning: Conditioning = field(default_factory=Conditioning.empty)
    latents: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    scheduler: Any = None
    generators: list[torch.Generator] = field(default_factory=list)
    step: int = 0  # steps done
    # A fresh scheduler set to the job's steps: what a checkpoint need not hold.
    # Built at the first capture: building one costs about as much as the rest.
    baseline: Any = None
    # The last checkpoint (or the start): the policy counts steps and seconds from it.
    marked_step: int = 0
    marked_at: float = 0.0
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
        latents (num_images, C, H/8, W/8) on the CPU, or what ended it: JobSuspended
        or JobInterrupted once its ``stopping`` was set, BadOutput, or the error of
        its own inputs. An error of the batch as a whole (the model, the device) is
        raised."""
        keys = {m.request.key for m in members}
        if len(keys) != 1:
            raise ValueError(f"a batch holds jobs of one shape, not {len(keys)}")
        key = keys.pop()
        spec = self.registry.get(key.model)
        if key.model not in self._models:  # a job waits for this load
            COLD_LOADS.labels(model=key.model).inc()
        pipe = self.load(key.model)
        policy = CheckpointPolicy(spec.checkpoint_every_steps, spec.checkpoint_every_s)
        if spec.family == "sim":
            return self._simulate(spec, key, members, policy)
        with torch.inference_mode():
            runs = [self._prepare(pipe, spec, m) for m in members]
            self._denoise(pipe, key, [r for r in runs if r.result is None], policy)
        for run in runs:
            if run.result is None:
                try:
                    check_output(run.latents, spec.min_output_std)
                    run.result = run.latents.to("cpu", torch.float32)
                except BadOutput as exc:
                    run.result = exc
        return [r.result if r.result is not None else RuntimeError("no result") for r in runs]

    def _simulate(
        self, spec: ModelSpec, key: BatchKey, members: Sequence[BatchMember], policy: CheckpointPolicy
    ) -> list[torch.Tensor | BaseException]:
        """A sim model's batch: the modelled time per step, then latents from each
        job's seeds. Its checkpoints hold the step alone."""
        runs = []
        for m in members:
            fingerprint = checkpoint.fingerprint(m.request, spec.scheduler)
            run = _Run(m, fingerprint, key.steps, checkpoint.capture(0, key.steps, fingerprint, None))
            if m.resume is not None:
                try:
                    self._restore(None, run, m.resume)
                except CheckpointMismatch as exc:
                    self._cannot_resume(run, m.resume, exc)
            runs.append(run)
        self._mark(runs)

        def on_step(i: int, step: int, total: int) -> None:
            runs[i].step = step
            members[i].on_step(step, total)
            self._checkpoint_if_due(runs[i], policy)

        finished = sim.sleep_steps(
            spec,
            key.width,
            key.height,
            key.steps,
            [m.stopping for m in members],
            on_step,
            [r.step for r in runs],
        )
        return [
            sim.latents(r.member.request) if done else self._stopped(r) for r, done in zip(runs, finished, strict=True)
        ]

    def _prepare(self, pipe: Any, spec: ModelSpec, member: BatchMember) -> _Run:
        req = member.request
        scheduler, generators = self._fresh_state(pipe, spec, req)
        fingerprint = checkpoint.fingerprint(req, type(scheduler).__name__)
        total = len(scheduler.timesteps)
        run = _Run(member, fingerprint, total, checkpoint.capture(0, total, fingerprint, None))
        run.scheduler, run.generators = scheduler, generators
        resumed = False
        if member.resume is not None:
            try:
                resumed = self._restore(pipe, run, member.resume)
            except CheckpointMismatch as exc:
                self._cannot_resume(run, member.resume, exc)
                # Restoring may have changed them before it failed.
                run.scheduler, run.generators = self._fresh_state(pipe, spec, req)
        if member.stopping.is_set():
            run.result = self._stopped(run)
            return run
        try:
            cfg = req.guidance_scale > 1.0
            run.conditioning = self.prompts.get(
                (req.model, req.prompt, req.negative_prompt, cfg, req.width, req.height),
                lambda: Conditioning.encode(pipe, spec.family, req, self.device, cfg),
            )
            if not resumed:
                from diffusers.utils.torch_utils import randn_tensor

                shape = (1, *self._latent_shape(pipe, req)[1:])
                # One draw per image from its own generator, as the diffusers pipelines do.
                dtype = pipe.unet.dtype
                noise = [randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in run.generators]
                run.latents = torch.cat(noise) * run.scheduler.init_noise_sigma
        except Exception as exc:  # this member's inputs: it fails alone
            run.result = exc
        return run

    def _fresh_state(self, pipe: Any, spec: ModelSpec, req: SampleRequest) -> tuple[Any, list[torch.Generator]]:
        """A new noise scheduler set to the job's steps, and each image's generator
        seeded: the state of a job at step 0, before its noise is drawn."""
        cls = scheduler_class(spec) if spec.scheduler else type(pipe.scheduler)
        scheduler = cls.from_config(pipe.scheduler.config)
        scheduler.set_timesteps(req.steps, device=self.device)
        generators = [
            torch.Generator(device=self.device).manual_seed((req.seed + i) % 2**63) for i in range(req.num_images)
        ]
        return scheduler, generators

    @staticmethod
    def _latent_shape(pipe: Any, req: SampleRequest) -> tuple[int, ...]:
        scale = pipe.vae_scale_factor
        return (req.num_images, pipe.unet.config.in_channels, req.height // scale, req.width // scale)

    # -- checkpoints -------------------------------------------------------------

    def _restore(self, pipe: Any, run: _Run, resume: Checkpoint) -> bool:
        """Puts ``run`` (fresh, at step 0) at ``resume``'s step. Returns whether it
        restored latents (False: a checkpoint with no state, whose run draws its
        noise as a fresh one does). Raises CheckpointMismatch for a checkpoint of
        another request, and for one this engine cannot continue (another kind of
        device, another dtype), having perhaps changed the run's scheduler."""
        snapshot = checkpoint.restore(resume, run.fingerprint, self.device)
        if resume.total != run.total:
            raise CheckpointMismatch(f"the checkpoint is of {resume.total} steps; this scheduler takes {run.total}")
        if run.scheduler is None:  # a sim run: its step is its whole state
            run.step, run.start = resume.step, resume
            return False
        if snapshot is None:
            if resume.step:
                raise CheckpointMismatch(f"the checkpoint of step {resume.step} holds no denoising state")
            run.start = resume
            return False
        self._check_snapshot(pipe, run, snapshot)
        try:
            for generator, state in zip(run.generators, snapshot.generators, strict=True):
                generator.set_state(state)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointMismatch(f"the checkpoint's generator state does not fit: {exc}") from None
        checkpoint.apply_scheduler_state(run.scheduler, snapshot.scheduler, snapshot.removed)
        run.latents = snapshot.latents
        run.step, run.start = resume.step, resume
        return True

    def _check_snapshot(self, pipe: Any, run: _Run, snapshot: Snapshot) -> None:
        if snapshot.device_type != self.device.type:
            # Generator states (and the arithmetic) differ by kind of device.
            raise CheckpointMismatch(f"the checkpoint was taken on {snapshot.device_type}, not {self.device.type}")
        shape = self._latent_shape(pipe, run.member.request)
        if tuple(snapshot.latents.shape) != shape or snapshot.latents.dtype != pipe.unet.dtype:
            raise CheckpointMismatch(
                f"the checkpoint's latents are {tuple(snapshot.latents.shape)} {snapshot.latents.dtype}, "
                f"not {shape} {pipe.unet.dtype}"
            )
        if len(snapshot.generators) != len(run.generators):
            raise CheckpointMismatch(f"the checkpoint holds {len(snapshot.generators)} generators")

    @staticmethod
    def _cannot_resume(run: _Run, resume: Checkpoint, exc: CheckpointMismatch) -> None:
        # Not an error of the job: from step 0 it still gets its image, only later.
        model = run.member.request.model
        log.warning(
            "a %s job cannot resume from its checkpoint of step %d; it runs from step 0: %s", model, resume.step, exc
        )
        run.step = 0

    def _capture(self, run: _Run) -> Checkpoint:
        """The run's checkpoint now, at a step boundary."""
        if run.scheduler is None:
            return checkpoint.capture(run.step, run.total, run.fingerprint, None)
        if run.baseline is None:
            run.baseline = type(run.scheduler).from_config(run.scheduler.config)
            run.baseline.set_timesteps(run.member.request.steps, device=self.device)
        changed, removed = checkpoint.scheduler_state(run.scheduler, run.baseline)
        generators = [g.get_state() for g in run.generators]
        snapshot = Snapshot(run.latents, generators, changed, removed, self.device.type)
        return checkpoint.capture(run.step, run.total, run.fingerprint, snapshot)

    def _stopped(self, run: _Run) -> JobInterrupted:
        """What a member whose ``stopping`` is set leaves with, at a step boundary."""
        model = run.member.request.model
        try:
            if not run.member.suspend():
                return JobInterrupted(model)
            # No step ran here: the state is the one it started from.
            return JobSuspended(model, run.start if run.step == run.start.step else self._capture(run))
        except Exception:
            # The job still stops; it reruns from its last checkpoint, or step 0.
            log.exception("a %s job could not be suspended at step %d; it is interrupted", model, run.step)
            return JobInterrupted(model)

    @staticmethod
    def _mark(runs: Sequence[_Run]) -> None:
        now = time.monotonic()
        for run in runs:
            run.marked_step, run.marked_at = run.step, now

    def _checkpoint_if_due(self, run: _Run, policy: CheckpointPolicy) -> None:
        """After a step: the member's periodic checkpoint, if the policy says so.
        None after the last step: the result follows at once."""
        if run.member.on_checkpoint is None or run.step >= run.total:
            return
        now = time.monotonic()
        if not policy.due(run.step - run.marked_step, now - run.marked_at):
            return
        run.marked_step, run.marked_at = run.step, now
        try:
            run.member.on_checkpoint(self._capture(run))
        except Exception:
            # A checkpoint only saves time on a resume: failing one never fails the job.
            log.exception("a %s job's checkpoint at step %d was not taken", run.member.request.model, run.step)

    # -- the loop ----------------------------------------------------------------

    def _denoise(self, pipe: Any, key: BatchKey, runs: list[_Run], policy: CheckpointPolicy) -> None:
        """Steps every run to its end, one step of each per round, each at its own
        step index: a resumed member finishes before a fresh one beside it."""
        if not runs:
            return
        takes_generator = "generator" in inspect.signature(runs[0].scheduler.step).parameters
        cfg = key.guidance_scale > 1.0
        self._mark(runs)
        while True:
            active = [r for r in runs if r.result is None and r.step < r.total]
            for r in active:
                if r.member.stopping.is_set():
                    r.result = self._stopped(r)
            active = [r for r in active if r.result is None]
            if not active:
                return
            for group in self._groups(active):
                t = group[0].scheduler.timesteps[group[0].step]
                noise = self._predict(pipe, group, t, cfg, key.guidance_scale)
                for r, eps in zip(group, noise, strict=True):
                    extra = {"generator": r.generators} if takes_generator else {}
                    r.latents = r.scheduler.step(eps, t, r.latents, **extra, return_dict=False)[0]
            for r in active:
                r.step += 1
                r.member.on_step(r.step, r.total)
                self._checkpoint_if_due(r, policy)

    def _groups(self, active: list[_Run]) -> list[list[_Run]]:
        """The runs that share one UNet call. Members of a batch share a model, its
        scheduler class and their steps, so the same step index is the same
        timestep; comparing indices spares a device sync per member."""
        if not self.fuse_batches:
            return [[r] for r in active]
        by_step: dict[int, list[_Run]] = {}
        for r in active:
            by_step.setdefault(r.step, []).append(r)
        return list(by_step.values())

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
