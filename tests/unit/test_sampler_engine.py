"""The sampler's batched denoising loop on the CPU, with the tiny model: a batched
job's image is exactly its solo image, members stop alone, memory is bounded."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

from gpu_worker.denoising.members import BadOutput, BatchMember, check_output
from gpu_worker.denoising.prompts import Conditioning, PromptCache
from gpu_worker.engine import SamplerEngine
from services.errors import JobInterrupted, ModelError
from services.generation import GenerationParams
from services.models.loader import module_bytes
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily, ModelSpec


def request(prompt: str, seed: int, images: int = 1, negative: str = "", model: str = "tiny") -> GenerationParams:
    return GenerationParams(model, prompt, negative, 64, 64, 6, 7.5, seed, images)


JOBS = [request("a cat", 1), request("a dog", 2, images=2), request("a cat", 3, negative="blurry")]


def member(
    req: GenerationParams, stopping: threading.Event | None = None, steps: list[int] | None = None
) -> BatchMember:
    return BatchMember(
        req, lambda step, total: steps.append(step) if steps is not None else None, stopping or threading.Event()
    )


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))


def solo(engine: SamplerEngine, req: GenerationParams) -> torch.Tensor:
    return engine.sample(req, lambda step, total: None, threading.Event())


def test_a_batched_job_gets_exactly_its_solo_latents(engine: SamplerEngine) -> None:
    alone = [solo(engine, r) for r in JOBS]
    batched = engine.sample_batch([member(r) for r in JOBS])
    for a, b in zip(alone, batched, strict=True):
        assert isinstance(b, torch.Tensor)
        assert torch.equal(a, b)
    assert [b.shape[0] for b in batched if isinstance(b, torch.Tensor)] == [1, 2, 1]


def test_solo_latents_are_the_diffusers_pipelines(engine: SamplerEngine, models_dir: Path) -> None:
    pipe = StableDiffusionPipeline.from_pretrained(
        models_dir / "tiny", vae=None, safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        reference = pipe(
            prompt="a dog",
            width=64,
            height=64,
            num_inference_steps=6,
            guidance_scale=7.5,
            num_images_per_prompt=2,
            generator=[torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)],
            output_type="latent",
        ).images
    torch.testing.assert_close(solo(engine, JOBS[1]), reference, rtol=0, atol=1e-6)


def test_a_multistep_solver_keeps_each_members_history(models_dir: Path) -> None:
    engine = SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))
    pipe = engine.load("tiny")
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    alone = [solo(engine, r) for r in JOBS]
    batched = engine.sample_batch([member(r) for r in JOBS])
    assert all(isinstance(b, torch.Tensor) and torch.equal(a, b) for a, b in zip(alone, batched, strict=True))


def test_a_stopped_member_leaves_and_the_rest_finish(engine: SamplerEngine) -> None:
    stop = threading.Event()
    steps: list[int] = []

    def on_step(step: int, total: int) -> None:
        steps.append(step)
        if step == 2:
            stop.set()  # as a cancel arriving during step 3 would

    leaving = BatchMember(JOBS[0], on_step, stop)
    results = engine.sample_batch([leaving, member(JOBS[1]), member(JOBS[2])])
    assert isinstance(results[0], JobInterrupted)
    assert steps == [1, 2]
    assert torch.equal(results[1], solo(engine, JOBS[1]))  # type: ignore[arg-type]
    assert torch.equal(results[2], solo(engine, JOBS[2]))  # type: ignore[arg-type]


def test_progress_reaches_every_member_at_every_step(engine: SamplerEngine) -> None:
    seen: list[list[int]] = [[], []]
    engine.sample_batch([member(JOBS[0], steps=seen[0]), member(JOBS[2], steps=seen[1])])
    assert seen == [[1, 2, 3, 4, 5, 6]] * 2


def test_a_batch_holds_one_model_and_size(engine: SamplerEngine) -> None:
    other = GenerationParams("tiny", "x", "", 96, 64, 6, 7.5, 1, 1)
    with pytest.raises(ValueError, match="one model and size"):
        engine.sample_batch([member(JOBS[0]), member(other)])


def test_prompt_embeddings_are_cached(models_dir: Path) -> None:
    engine = SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))
    engine.sample_batch([member(JOBS[0]), member(request("a cat", 9))])
    assert (engine.prompts.misses, engine.prompts.hits) == (1, 1)
    engine.unload("tiny")
    assert len(engine.prompts) == 0  # a dropped model's embeddings go with it


def test_prompt_cache_is_bounded_by_bytes() -> None:
    row = Conditioning(torch.zeros(1, 77, 8), torch.zeros(1, 77, 8))  # 2 x 77 x 8 x 4 bytes
    cache = PromptCache(max_bytes=3 * row.nbytes)
    for i in range(5):
        cache.get(("m", str(i)), lambda: row)
    assert len(cache) == 3 and cache.bytes == 3 * row.nbytes
    cache.get(("m", "4"), lambda: row)
    assert cache.hits == 1
    cache.get(("m", "0"), lambda: row)  # the oldest was evicted
    assert cache.misses == 6


def test_prompts_are_encoded_one_at_a_time_and_once_whichever_threads_ask() -> None:
    """The sampling thread, a batch prepared ahead and prompts encoded while a start
    is written may ask together: encodings never overlap (tokenizers are not safe
    across threads), and a prompt being encoded is waited for, not encoded twice."""
    row = Conditioning(torch.zeros(1, 4), torch.zeros(1, 4))
    cache = PromptCache(max_bytes=1 << 20)
    encoding, most, calls = 0, 0, []
    guard = threading.Lock()

    def compute(key: str) -> Conditioning:
        nonlocal encoding, most
        with guard:
            encoding += 1
            most = max(most, encoding)
            calls.append(key)
        time.sleep(0.02)
        with guard:
            encoding -= 1
        return row

    keys = ["a", "a", "b", "a", "b", "c"]
    with ThreadPoolExecutor(len(keys)) as pool:
        found = list(pool.map(lambda k: cache.get(("m", k), lambda: compute(k)), keys))
    assert all(f is row for f in found)
    assert most == 1
    assert sorted(calls) == ["a", "b", "c"]
    assert (cache.misses, cache.hits) == (3, 3)


def test_output_check_rejects_nan_inf_and_degenerate_latents() -> None:
    good = torch.randn(2, 4, 8, 8)
    check_output(good, 1e-3)
    with pytest.raises(BadOutput, match="NaN"):
        check_output(torch.full((1, 4, 8, 8), float("nan")), 1e-3)
    with pytest.raises(BadOutput, match="NaN or infinite"):
        check_output(torch.full((1, 4, 8, 8), float("inf")), 1e-3)
    flat = torch.cat([good[:1], torch.full((1, 4, 8, 8), 0.25)])
    with pytest.raises(BadOutput, match="image 1 is degenerate"):
        check_output(flat, 1e-3)


def two_models(models_dir: Path) -> ModelRegistry:
    # Both are the tiny model, built under their own names, and declared smaller
    # than they are: only the measured bytes tell.
    tiny = {**ModelRegistry.load().get("tiny").__dict__, "vram_mb": 1}
    return ModelRegistry(
        {
            "a": ModelSpec(**{**tiny, "name": "a"}),
            "b": ModelSpec(**{**tiny, "name": "b"}),
        }
    )


def test_loading_past_the_memory_budget_evicts_and_counts_real_bytes(models_dir: Path) -> None:
    registry = two_models(models_dir)
    probe = SamplerEngine(registry, models_dir, torch.device("cpu"))
    size = module_bytes(probe.load("a"))
    assert probe.footprints()["a"]["bytes"] == size > 0
    engine = SamplerEngine(registry, models_dir, torch.device("cpu"), memory_budget_bytes=int(size * 1.5))
    engine.load("a")
    engine.load("b")
    assert engine.warm_models() == ["b"]
    roomy = SamplerEngine(registry, models_dir, torch.device("cpu"), memory_budget_bytes=size * 3)
    roomy.load("a")
    roomy.load("b")
    assert roomy.warm_models() == ["a", "b"]


def test_a_model_that_cannot_fit_is_refused(models_dir: Path) -> None:
    engine = SamplerEngine(two_models(models_dir), models_dir, torch.device("cpu"), memory_budget_bytes=2**19)
    with pytest.raises(ModelError, match="does not fit"):
        engine.load("a")


def test_warm_up_runs_a_generation(models_dir: Path) -> None:
    engine = SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"), pinned=["tiny"])
    assert engine.warm_up("tiny") > 0
    assert engine.warm_models() == ["tiny"]
    assert engine.prompts.misses == 1


def test_the_registry_picks_the_attention_implementation(models_dir: Path) -> None:
    from diffusers.models.attention_processor import AttnProcessor

    tiny = ModelRegistry.load().get("tiny")
    registry = ModelRegistry({"tiny": ModelSpec(**{**tiny.__dict__, "attention": "eager"})})
    engine = SamplerEngine(registry, models_dir, torch.device("cpu"))
    processors = engine.load("tiny").unet.attn_processors.values()
    assert processors and all(type(p) is AttnProcessor for p in processors)
    # Another implementation of the same attention: the same latents, within float error.
    eager = solo(engine, JOBS[0])
    default = solo(SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu")), JOBS[0])
    torch.testing.assert_close(eager, default, rtol=1e-4, atol=1e-4)


def test_a_member_whose_inputs_fail_fails_alone(engine: SamplerEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    encode = Conditioning.encode

    def fragile(
        pipe: object, family: ModelFamily, req: GenerationParams, device: torch.device, cfg: bool
    ) -> Conditioning:
        if req.prompt == "breaks":
            raise ValueError("this prompt cannot be encoded")
        return encode(pipe, family, req, device, cfg)

    monkeypatch.setattr(Conditioning, "encode", staticmethod(fragile))
    results = engine.sample_batch([member(request("breaks", 5)), member(JOBS[0]), member(JOBS[1])])
    assert isinstance(results[0], ValueError)
    assert torch.equal(results[1], solo(engine, JOBS[0]))  # type: ignore[arg-type]
    assert torch.equal(results[2], solo(engine, JOBS[1]))  # type: ignore[arg-type]
