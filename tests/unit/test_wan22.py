"""Wan 2.2 A14B's two experts in the sampler's loop, on the CPU with its miniature (two
tiny Wan transformers switched at the boundary): a job crossing the boundary gets
the latents diffusers' own ``WanPipeline`` makes (within 1e-5), its early steps the
high-noise expert's and its late ones the low-noise one's; a job that joins a running
batch on the other side of the boundary (one call, its rows split between the
experts) gets its solo latents, as does the member already running; one suspended
before the boundary resumes after it, in another engine, to its uninterrupted
latents; compiled, both experts compile as it loads; step caching reuses no
prediction across the boundary, and a job suspended there resumes as uninterrupted;
and a model of two experts
refuses adapters (its slots would adapt one expert). A group splits both experts
alike (``tests/integration/test_parallel_models.py``). About 25 CPU s, most of it the
compilation."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberResult
from gpu_worker.denoising.running_batch import Cohort, RunningBatch
from gpu_worker.engine import SamplerEngine
from services.errors import ModelError
from services.generation import GenerationParams
from services.models import speed
from services.models.prompt_encoding import WAN_TEXT_LEN
from services.models.registry import ModelRegistry
from services.models.wan import WAN22_T2V_BOUNDARY

CPU = torch.device("cpu")
MODEL = "tiny-wan22"
# Four steps of the flow-shifted schedule: timesteps 999 and 900 the high-noise
# expert's (at or above 875), 750 and 500 the low-noise one's.
STEPS = 4


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry({MODEL: ModelRegistry.load().get(MODEL)})


@pytest.fixture(scope="module")
def model_dir(models_dir: Path) -> Path:
    return models_dir / MODEL


@pytest.fixture(scope="module")
def engine(registry: ModelRegistry, models_dir: Path, model_dir: Path) -> SamplerEngine:
    return SamplerEngine(registry, models_dir, CPU)


def params(seed: int, steps: int = STEPS, guidance: float = 5.0) -> GenerationParams:
    return GenerationParams(MODEL, f"waves {seed}", "", 64, 48, steps, guidance, seed, 1, frames=9, fps=8.0)


def member(
    p: GenerationParams, on_step: Callable[[int, int], None] = lambda step, total: None, **extra: Any
) -> BatchMember:
    return BatchMember(p, on_step, extra.pop("stopping", threading.Event()), **extra)


def solo(engine: SamplerEngine, p: GenerationParams) -> torch.Tensor:
    return engine.sample(p, lambda step, total: None, threading.Event())


def tensor(result: MemberResult) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), result
    return result


def calls_of(network: Any, seen: list[float]) -> Any:
    """A hook noting each call's first timestep."""
    return network.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append(float(kwargs["timestep"].flatten()[0])), with_kwargs=True
    )


def test_a_job_crossing_the_boundary_gets_the_pipelines_latents(
    engine: SamplerEngine, model_dir: Path, one_thread: None
) -> None:
    from diffusers import WanPipeline

    p = params(7)
    pipe: Any = WanPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.boundary_ratio == WAN22_T2V_BOUNDARY and pipe.transformer_2 is not None
    expected = pipe(
        p.prompt,
        negative_prompt="",
        height=p.height,
        width=p.width,
        num_frames=p.frames,
        num_inference_steps=p.steps,
        guidance_scale=p.guidance_scale,
        generator=torch.Generator().manual_seed(p.seed),
        max_sequence_length=WAN_TEXT_LEN,
        output_type="latent",
    ).frames
    loaded = engine.load(MODEL)
    early: list[float] = []
    late: list[float] = []
    hooks = [calls_of(loaded.transformer, early), calls_of(loaded.transformer_2, late)]
    try:
        got = solo(engine, p)
    finally:
        for hook in hooks:
            hook.remove()
    # Within 1e-5, not equal: the loop's guided step is one call of doubled rows where the
    # pipeline makes two, and a CPU blocks their matrix products differently (Wan 2.1's
    # miniature differs from its pipeline by the same 2e-6).
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    boundary = WAN22_T2V_BOUNDARY * 1000
    assert len(early) == len(late) == 2 and min(early) >= boundary > max(late), (early, late)


def test_a_job_joining_on_the_other_side_of_the_boundary_gets_its_solo_latents(
    engine: SamplerEngine, one_thread: None
) -> None:
    """Fused as on a GPU, where members share calls: in the steps the joiner takes on the
    high-noise expert while the running member is on the low-noise one, each expert has
    a call of its own (never one of both: each would compute the other's rows), so each
    member's latents are its solo ones."""
    running, late = params(10), params(11, guidance=4.0)
    left: list[Cohort] = []

    def on_step(step: int, total: int) -> None:
        if step == 2:  # the running member's next step is past the boundary
            assert batch.offer([member(late)]) == 1

    denoiser: Any = engine.denoiser_for(engine.registry.get(MODEL))
    pipe = engine.load(MODEL)
    rows: list[int] = []
    hooks = [
        expert.register_forward_pre_hook(
            lambda _module, _args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        for expert in (pipe.transformer, pipe.transformer_2)
    ]
    first = member(running, on_step)
    batch = RunningBatch(running.join_key, 8, [first], left.append)
    denoiser.fuse_batches = True
    try:
        results = engine.sample_batch([first], batch)
    finally:
        denoiser.fuse_batches = False
        for hook in hooks:
            hook.remove()
    # Four steps each, every call one member's two rows (its prompt's and its negative's).
    assert rows == [2] * 8
    joined = next(result for cohort in left for m, result in cohort if m.params.prompt == late.prompt)
    assert torch.equal(tensor(joined), solo(engine, late))
    assert torch.equal(tensor(results[0]), solo(engine, running))


def resumes_as_uninterrupted(registry: ModelRegistry, models_dir: Path, p: GenerationParams, at: int) -> None:
    """``p`` suspended once step ``at`` is done resumes, in another engine, to the
    latents a third engine makes of it uninterrupted."""
    stop = threading.Event()

    def on_step(step: int, total: int) -> None:
        if step == at:
            stop.set()

    [result] = SamplerEngine(registry, models_dir, CPU).sample_batch(
        [member(p, on_step, stopping=stop, suspend=lambda: True)]
    )
    assert isinstance(result, JobSuspended) and result.checkpoint.step == at
    [resumed] = SamplerEngine(registry, models_dir, CPU).sample_batch([member(p, resume=result.checkpoint)])
    assert torch.equal(tensor(resumed), solo(SamplerEngine(registry, models_dir, CPU), p))


def with_options(registry: ModelRegistry, **options: Any) -> ModelRegistry:
    """The miniature alone, with ``options``."""
    return ModelRegistry({MODEL: replace(registry.get(MODEL), **options)})


def test_a_job_suspended_before_the_boundary_resumes_after_it_in_another_engine(
    registry: ModelRegistry, models_dir: Path, model_dir: Path, one_thread: None
) -> None:
    resumes_as_uninterrupted(registry, models_dir, params(21, steps=6), at=2)


def test_compiled_both_experts_compile_as_the_model_loads_and_keep_the_latents(
    registry: ModelRegistry, models_dir: Path, model_dir: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their blocks compiled (as tests compile: ``aot_eager``, the traced graphs run as
    they are), the warm-up's two steps one on each expert."""
    monkeypatch.setattr(speed, "COMPILE_BACKEND", "aot_eager")
    engine = SamplerEngine(with_options(registry, compile=True, max_batch=1, max_images=1), models_dir, CPU)
    pipe = engine.load(MODEL)
    for expert in (pipe.transformer, pipe.transformer_2):
        assert all(block._compiled_call_impl is not None for block in expert.blocks)
    p = params(31)
    assert torch.allclose(solo(engine, p), solo(SamplerEngine(registry, models_dir, CPU), p), atol=1e-5, rtol=0)


def test_step_caching_never_reuses_the_other_expert_s_prediction(
    registry: ModelRegistry, models_dir: Path, model_dir: Path, one_thread: None
) -> None:
    """With a threshold that reuses every step it may: the first step past the boundary
    computes on the low-noise expert, and that expert's own rate starts there (its next
    step computes too), the last step computing as always. Eight steps: 0-2 early, 3-7
    late."""
    engine = SamplerEngine(with_options(registry, step_cache=0.99), models_dir, CPU)
    pipe = engine.load(MODEL)
    early: list[float] = []
    late: list[float] = []
    hooks = [calls_of(pipe.transformer, early), calls_of(pipe.transformer_2, late)]
    try:
        solo(engine, params(41, steps=8))
    finally:
        for hook in hooks:
            hook.remove()
    boundary = WAN22_T2V_BOUNDARY * 1000
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(8)
    timesteps = [float(t) for t in scheduler.timesteps]
    first_late = next(t for t in timesteps if t < boundary)
    assert early == timesteps[:2] and min(timesteps[:3]) >= boundary  # the third early step reused
    assert late[:2] == [first_late, timesteps[timesteps.index(first_late) + 1]] and late[-1] == timesteps[-1]
    assert len(early) + len(late) < 8  # some steps were reused


def test_step_caching_suspended_at_the_boundary_resumes_as_uninterrupted(
    registry: ModelRegistry, models_dir: Path, model_dir: Path, one_thread: None
) -> None:
    """Suspended with its next step the first past the boundary: the phase of its last
    computation travels in the checkpoint, so the resumed job computes that step and
    reuses as it would have, to the uninterrupted latents."""
    resumes_as_uninterrupted(with_options(registry, step_cache=0.99), models_dir, params(51, steps=8), at=3)


def test_a_model_of_two_experts_refuses_adapters_which_would_adapt_one(
    registry: ModelRegistry, models_dir: Path, model_dir: Path
) -> None:
    engine = SamplerEngine(with_options(registry, adapter_slots=4), models_dir, CPU)
    with pytest.raises(ModelError, match=f"model '{MODEL}': .*adapter_slots"):
        engine.load(MODEL)
