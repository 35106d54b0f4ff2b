"""The denoising loop every diffusers family shares, run step by step over a batch
of jobs; each family (``gpu_worker.families``: ``unet``, ``sd3``, ``flux``, ``qwen_image``,
``z_image``, ``wan``, ``upscale``) says how its pipeline loads, what shape its latents
have, how a prompt is encoded and how one step's noise is predicted
(``diffusers_family``, what the loop asks of a family).

Each member keeps its own noise (its seeds), noise-scheduler state, steps, guidance
scale, progress and stop: a cancelled or timed-out member leaves at the next step
and the rest go on, and a job may join a running batch at a step boundary and leave
when its own steps are done (``running_batch``). On a GPU the members' network calls
of a step are fused into one (``step_groups``); on a CPU each member's call runs on
its own rows, the only way its output is exactly the one it would get alone.

A member given a checkpoint starts from its step, with its own step index, beside
members that start from 0; an edit starts at the step its strength gives, from its
input image's latents noised to that step, and an inpainting member keeps the
input outside its mask at every step, as diffusers' pipelines do for a model of
four latent channels. What resuming needs beyond the latents (an edit's input
latents, its mask, its first noise) travels in the checkpoint. Resuming gives
exactly the uninterrupted output on a CPU (on a GPU, what rerunning the job would
give there).

The GPU never waits for the host inside the loop: the noise schedulers decide on the
host (``noise_schedulers``), progress and stops are host flags, and nothing is read
back but at a boundary a member asks for (a preview, a checkpoint, a suspension) and
at its end; a test runs the loop on the meta device, where any read back fails.

A few lines over 300: the load and the loop it prepares the network for read together."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gpu_worker.adapters.library import attach_slots, slots_of
from gpu_worker.denoising.checkpoint_capture import LoopState, MemberCheckpoints, MemberRun, Resumption
from gpu_worker.denoising.diffusers_family import ConditioningNotServed, DiffusersFamily
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.lockstep import ALONE
from gpu_worker.denoising.members import BatchMember, MemberResult, checked_output
from gpu_worker.denoising.network_calls import NetworkCalls, warm_up_buckets
from gpu_worker.denoising.noise_schedulers import host_scheduler, keep_unmasked
from gpu_worker.denoising.parallel_network import check_shares, shard_weights, split_network
from gpu_worker.denoising.running_batch import BatchJoins
from gpu_worker.denoising.step_cache import StepCache, cached_steps
from gpu_worker.denoising.step_groups import guided_noise, step_groups, takes_generator
from services.generation import GenerationParams
from services.models import loader, speed
from services.models.compile_cache import CompileKey, compile_key, content_digest
from services.models.device import module_dtype
from services.models.loader import Loaded
from services.models.sources import resolve_source
from services.models.spec import ModelSpec, scheduler_class
from services.models.text_encoders import TEXT_ENCODERS, text_encoder_names

log = logging.getLogger(__name__)

__all__ = ["TEXT_ENCODERS", "ConditioningNotServed", "DiffusersDenoiser", "DiffusersFamily"]


class DiffusersDenoiser(DiffusersFamily):
    """A family of diffusers pipelines run through the loop: loaded, and its members
    denoised step by step together."""

    def load(self, spec: ModelSpec) -> Loaded:
        from diffusers import DiffusionPipeline

        dtype = loader.compute_dtype(spec, self.device)
        parts = self.pipeline_parts(spec)
        if self.text_elsewhere(spec):
            # Loaded by the decoder service (or a follower's leader): the bytes here are the network's alone.
            parts.update(dict.fromkeys(text_encoder_names(spec, self.models_dir), None))
        host: tuple[str, ...] = TEXT_ENCODERS if spec.text_encoders == "host" else ()
        shape = self.group.of(spec.parallel) if self.group is not None and self.group.serves(spec.parallel) else None
        sharded = shape is not None and shape.shard_mesh is not None
        if sharded:
            host += (self.network_name, *self.more_network_names)  # whole on the host until sharded
        loaded = loader.load(
            DiffusionPipeline, spec, self.models_dir, self.device, dtype=dtype, host_parts=host, **parts
        )
        pipe = loaded.value
        if shape is not None and sharded:
            for network in self.networks(pipe):  # a card holds its shards only
                shard_weights(network, spec, shape, self.device)
            loaded = replace(loaded, bytes=loaded.bytes + sum(map(loader.module_bytes, self.networks(pipe))))
        pipe.set_progress_bar_config(disable=True)
        options = speed.SpeedOptions.of(spec, self.device)
        if spec.adapter_slots:
            rows = 2 * max(spec.max_batch, spec.max_images)  # a guided call doubles its rows
            slots = attach_slots(pipe, self.network(pipe), spec, rows, module_dtype(self.network(pipe)))
            loaded = replace(loaded, bytes=loaded.bytes + slots.bytes)  # the adapters' own budget, on the device
        if shape is not None:
            for network in self.networks(pipe):
                split_network(network, shape)
        self.prepare_network(pipe, spec, options)
        # A warm-up has no conditioning where a decoder encodes it: the first jobs compile.
        if options.compile and spec.text_encoders != "service":
            loaded = self._compile(pipe, spec, options, dtype, loaded)
        return loaded

    def _compile(
        self, pipe: Any, spec: ModelSpec, options: speed.SpeedOptions, dtype: torch.dtype, loaded: Loaded
    ) -> Loaded:
        """The network compiled as it warms up for each bucket; through the fleet's
        compile cache where there is one (loaded first; shared after a miss)."""
        rows = self._max_rows(spec)
        cache, key = self.compile_cache, self._compile_key(spec, options, dtype, rows)
        cached = cache.load(key) if cache is not None and key is not None else None
        took = warm_up_buckets(self, pipe, spec, rows)
        if cache is not None and key is not None and cached is not None and cached.shares:
            cache.save(key)
        if cached is not None and key is not None:
            log.info("%s: the fleet's compile cache: %s (%s)", spec.name, cached.value, key.digest())
        return replace(loaded, seconds=loaded.seconds + took, compile_s=took, compile_cache=cached)

    def _compile_key(
        self, spec: ModelSpec, options: speed.SpeedOptions, dtype: torch.dtype, rows: int
    ) -> CompileKey | None:
        """What makes the model's compilation valid (``compile_cache``); None where
        nothing of it is kept: a backend of a test's, which generates no code."""
        if self.compile_cache is None or not isinstance(speed.COMPILE_BACKEND, str):
            return None
        source, _ = resolve_source(spec, self.models_dir)
        shapes: tuple[Any, ...] = (spec.default_width, spec.default_height, spec.default_frames, speed.buckets(rows))
        shapes += (str(dtype),)
        if self.group is not None and self.group.serves(spec.parallel):
            # Split, its graphs hold the group's collectives: each rank's are its own.
            shapes += (spec.parallel.describe(), f"rank {self.group.rank} of {self.group.size}")
        compiled = replace(options, step_cache=0.0)  # the loop's, not the network's
        return compile_key(content_digest(Path(source)), self.device, compiled, speed.COMPILE_BACKEND, shapes)

    def sample(
        self,
        pipe: Any,
        spec: ModelSpec,
        members: Sequence[BatchMember],
        checkpoints: MemberCheckpoints,
        joins: BatchJoins | None = None,
    ) -> list[MemberResult]:
        runs = self.denoise(pipe, spec, members, checkpoints, joins)
        for run in runs:
            self._read_back(pipe, run, spec)
        return [r.result if r.result is not None else RuntimeError("no result") for r in runs]

    def denoise(
        self,
        pipe: Any,
        spec: ModelSpec,
        members: Sequence[BatchMember],
        checkpoints: MemberCheckpoints,
        joins: BatchJoins | None = None,
    ) -> list[DiffusersRun]:
        """The members (and those that join at a step boundary) prepared and stepped
        to their ends. Without ``joins`` their latents are left on the device: nothing
        is read back but what a member's boundaries ask for; with it, each member's
        latents are read back as it leaves and handed out at once."""
        options = speed.SpeedOptions.of(spec, self.device)
        spans = self.group is not None and self.group.serves(spec.parallel)
        group = self.group.of(spec.parallel) if spans and self.group is not None else None
        lockstep = self.lockstep if group is not None else ALONE
        calls = NetworkCalls(options, self._max_rows(spec), group, lockstep)
        runs: list[DiffusersRun] = []
        try:
            with torch.inference_mode():
                runs.extend(self._prepare(pipe, spec, m, checkpoints) for m in members)
                lockstep.agree(runs)
                self._denoise(pipe, spec, runs, checkpoints, calls, joins)
        finally:
            slots = slots_of(pipe)
            if slots is not None:
                slots.release([key for r in runs for key, _ in r.adapters])
        return runs

    def _prepare(self, pipe: Any, spec: ModelSpec, member: BatchMember, checkpoints: MemberCheckpoints) -> DiffusersRun:
        """The member at its first step: resumed from its checkpoint if that fits, its
        prompt encoded (or cached) and, unless resumed, started afresh."""
        params = member.params
        state = self._fresh_state(pipe, spec, params)
        run = DiffusersRun.fresh(member, type(state.scheduler).__name__, len(state.scheduler.timesteps), state)
        run.network_timesteps = state.scheduler.timesteps.to(self.device)
        # In the latents' dtype: Z-Image guides in float32, whatever its network's.
        run.network_guidance = torch.tensor([params.guidance_scale], dtype=self.latent_dtype(pipe)).to(self.device)
        resumed = Resumption.STEP
        if member.resume is not None:
            latents = (self.latent_shape(pipe, params), self.latent_dtype(pipe))
            resumed = checkpoints.resume(run, member.resume, latents)
            if resumed is Resumption.REFUSED:
                run.state = self._fresh_state(pipe, spec, params)  # restoring may have changed it
        if member.stopping.is_set():
            run.result = checkpoints.stopped(run)
            return run
        try:
            check_shares(self.network(pipe), self.image_tokens(pipe, params), params.width, params.height)
            run.adapters = self.hold_adapters(pipe, spec, params)
            run.conditioning = self.encode_cached(pipe, spec, params, member.inputs)
            if resumed is not Resumption.LATENTS:
                self.start(pipe, run, member)
        except Exception as exc:  # this member's inputs: it fails alone
            run.result = exc
        return run

    def _fresh_state(self, pipe: Any, spec: ModelSpec, params: GenerationParams) -> LoopState:
        """A new noise scheduler set to the job's steps, and each output's generator
        seeded: the state of a job at step 0, before its noise is drawn."""
        cls = scheduler_class(spec) if spec.scheduler else type(pipe.scheduler)
        timesteps = self.timestep_args(pipe, params)

        def new_scheduler() -> Any:
            return host_scheduler(cls, pipe, params, **timesteps)

        scheduler = new_scheduler()
        seeds = [(params.seed + i) % 2**63 for i in range(params.num_images)]
        generators = [torch.Generator(device=self.generator_device).manual_seed(seed) for seed in seeds]
        return LoopState(torch.empty(0), scheduler, generators, new_scheduler)

    def _denoise(
        self,
        pipe: Any,
        spec: ModelSpec,
        runs: list[DiffusersRun],
        checkpoints: MemberCheckpoints,
        calls: NetworkCalls,
        joins: BatchJoins | None,
    ) -> None:
        """Steps every run to its end, one step of each per round, each at its own
        step index (a resumed member finishes before a fresh one beside it); at each
        boundary the members offered to ``joins`` come in, and those done leave."""
        checkpoints.mark([r for r in runs if r.result is None])
        threshold = calls.options.step_cache
        cache = StepCache(threshold, partial(self.step_phase, pipe)) if threshold else None
        left: set[int] = set()
        while True:
            for r in calls.lockstep.stopping([r for r in runs if r.result is None and r.step < r.total]):
                r.result = checkpoints.stopped(r)
            self._leave(pipe, spec, [r for r in runs if id(r) not in left and _done(r)], left, joins)
            active = [r for r in runs if not _done(r)]
            if joins is not None:
                joined = joins.joining() if active else joins.close()
                for member in joined:
                    runs.append(self._prepare(pipe, spec, member, checkpoints))
                    checkpoints.mark(runs[-1:])
                calls.lockstep.agree(runs[len(runs) - len(joined) :])
                if joined:
                    continue  # a joiner may have failed or stopped before its first step
                joins.stepped([r.member for r in active], max((r.total - r.step for r in active), default=0))
            if not active:
                return
            reusing = cache.reusing(active) if cache is not None else set()
            computing = [r for r in active if id(r) not in reusing]
            key = partial(self.call_key, pipe)
            for group in step_groups(computing, fuse=self.fuse_batches, guided=self.classifier_free, key=key):
                for r, eps in zip(group, guided_noise(self, pipe, group, calls), strict=True):
                    if cache is not None:
                        cache.computed(r, eps)
                    _step(r, eps)
            for r in active:
                if id(r) in reusing:
                    _step(r, StepCache.reused(r))
            for r in active:
                r.step += 1
                r.member.on_step(r.step, r.total)
                if r.step in r.member.preview_at and r.member.on_preview is not None:
                    latents = self.output_latents(pipe, r.member.params, _state(r).latents.detach())
                    r.member.on_preview(r.step, r.total, latents.to("cpu", torch.float32))
                checkpoints.stepped(r)

    def _leave(
        self, pipe: Any, spec: ModelSpec, done: list[DiffusersRun], left: set[int], joins: BatchJoins | None
    ) -> None:
        """Members done at this boundary leave: with ``joins``, read back and handed out now."""
        if joins is None or not done:
            return
        for r in done:
            self._read_back(pipe, r, spec)
            left.add(id(r))
        joins.leave([(r.member, r.result if r.result is not None else RuntimeError("no result")) for r in done])

    def _read_back(self, pipe: Any, run: DiffusersRun, spec: ModelSpec) -> None:
        """The one read back a member needs, once, as it ends."""
        if run.result is None and run.state is not None:
            latents = self.output_latents(pipe, run.member.params, run.state.latents)
            run.result = checked_output(latents, spec.min_output_std)
            report, cached = run.member.on_cached_steps, cached_steps(run)
            if report is not None and cached is not None:
                report(cached)


def _step(run: DiffusersRun, prediction: torch.Tensor) -> None:
    """The member's noise scheduler steps its latents by ``prediction``."""
    state = _state(run)
    t = state.scheduler.timesteps[run.step]
    extra = {"generator": state.generators} if takes_generator(state.scheduler) else {}
    state.latents = state.scheduler.step(prediction, t, state.latents, **extra, return_dict=False)[0]
    keep_unmasked(state, run.step)


def _done(run: DiffusersRun) -> bool:
    return run.result is not None or run.step >= run.total


def _state(run: MemberRun) -> LoopState:
    """A diffusers run's state: it always has one."""
    assert run.state is not None
    return run.state
