"""Prompts encoded while a job's start is written: what a dispatch carries is what
the job's record makes, so the batch that runs it finds its conditioning cached
(the tiny model on a real engine); a dispatch that carries no prompts starts
nothing, and one for a model not loaded here loads nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.engine import SamplerEngine
from gpu_worker.jobs.prompts_ahead import PromptsAhead
from services.bus.dispatch import Dispatch
from services.generation import GenerationParams, JobShape, Prompts
from services.models.registry import ModelRegistry

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    engine = SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))
    engine.load("tiny")
    return engine


def dispatch(job_id: str, prompts: Prompts | None, model: str = "tiny") -> Dispatch:
    return Dispatch(job_id, 1, 0.0, "pass", 1, JobShape(model, 64, 64, 4, 7.5, 2), prompts)


async def test_a_prompt_encoded_ahead_is_the_one_its_batch_finds(engine: SamplerEngine) -> None:
    ahead = PromptsAhead(engine)
    misses, hits = engine.prompts.misses, engine.prompts.hits
    ahead.start([dispatch("j1", Prompts("a lighthouse at dusk", "fog")), dispatch("j2", None)])
    await ahead.wait(["j1", "j2"])
    assert engine.prompts.misses == misses + 1
    # As the job's record has it: its seed and adapters are no part of its conditioning.
    record = GenerationParams("tiny", "a lighthouse at dusk", "fog", 64, 64, 4, 7.5, 12345, 2)
    engine.encode_prompts([record])
    assert (engine.prompts.misses, engine.prompts.hits) == (misses + 1, hits + 1)


async def test_nothing_is_encoded_for_what_it_cannot_encode_ahead(engine: SamplerEngine) -> None:
    ahead = PromptsAhead(engine)
    misses = engine.prompts.misses
    ahead.start([dispatch("j3", None), dispatch("j4", Prompts("a door", ""), model="tiny-sd3")])
    await ahead.wait(["j3", "j4"])
    assert engine.prompts.misses == misses
    assert engine.warm_models() == ["tiny"]  # tiny-sd3 not loaded for it
    ahead.start([dispatch("j5", Prompts("a window", ""))])
    ahead.forget(["j5"])
    await ahead.wait(["j5"])  # forgotten: nothing to wait for


def test_only_a_loaded_model_whose_family_reads_prompts_encodes_them(engine: SamplerEngine, models_dir: Path) -> None:
    assert engine.encodes_prompts("tiny")
    assert not engine.encodes_prompts("tiny-sd3"), "not loaded here"
    assert not engine.encodes_prompts("no-such-model")
    sim = SamplerEngine(ModelRegistry.load(REPO / "bench" / "sim_registry.toml"), models_dir, torch.device("cpu"))
    sim.load("sim")
    assert sim.warm_models() == ["sim"] and not sim.encodes_prompts("sim")
