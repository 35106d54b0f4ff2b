"""Step caching on the CPU with the miniatures: a cached step calls no network and
reuses its job's last prediction, the images stay close to uncached ones (bounded
here; ``bench/step_cache.py`` prints the speed-up and the pixels' drift), and each
job decides alone: in a batch, beside joiners at other steps, a job's image is its
solo image; suspended and resumed, it is its uninterrupted image, its cached steps
counted across both."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.denoising import diffusers_denoiser
from gpu_worker.denoising.members import BatchMember, JobSuspended
from gpu_worker.denoising.step_cache import relative_change
from gpu_worker.engine import SamplerEngine
from services.errors import ModelError
from services.generation import GenerationParams
from services.models import speed
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily
from tests.unit.test_speed_options import Compilations

CPU = torch.device("cpu")
STEPS = 20
THRESHOLD = 0.1


def engine(models_dir: Path, model: str = "tiny", threshold: float = THRESHOLD, **options: Any) -> SamplerEngine:
    spec = replace(ModelRegistry.load().get(model), step_cache=threshold, **options)
    return SamplerEngine(ModelRegistry({model: spec}), models_dir, CPU)


def job(seed: int, model: str = "tiny", images: int = 1, steps: int = STEPS, guidance: float = 7.5) -> GenerationParams:
    return GenerationParams(model, "a lighthouse at dusk", "", 64, 64, steps, guidance, seed, images)


class Member:
    """A member that records its steps and its cached-step count, and is suspended
    once ``suspend_at`` steps are done."""

    def __init__(self, params: GenerationParams, suspend_at: int = -1, resume: Checkpoint | None = None) -> None:
        self.steps: list[int] = []
        self.cached: list[int] = []
        self.stopping = threading.Event()
        self.suspend_at = suspend_at
        self.member = BatchMember(
            params, self.on_step, self.stopping, resume=resume, suspend=lambda: True, on_cached_steps=self.cached.append
        )

    def on_step(self, step: int, total: int) -> None:
        self.steps.append(step)
        if step == self.suspend_at:
            self.stopping.set()


def latents(result: torch.Tensor | BaseException) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), result
    return result


def calls_of(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The steps of the members in each network call (``guided_noise``) from now on."""
    calls: list[list[int]] = []
    predict = diffusers_denoiser.guided_noise

    def spy(denoiser: Any, pipe: Any, group: list[Any], *args: Any) -> list[torch.Tensor]:
        calls.append([r.step for r in group])
        return predict(denoiser, pipe, group, *args)

    monkeypatch.setattr(diffusers_denoiser, "guided_noise", spy)
    return calls


@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_cached_steps_call_no_network_and_stay_close(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    params = job(1, model, images=2)
    [uncached] = engine(models_dir, model, threshold=0).sample_batch([Member(params).member])
    calls = calls_of(monkeypatch)
    member = Member(params)
    [cached] = engine(models_dir, model).sample_batch([member.member])
    computed = [step for [step] in calls]
    [count] = member.cached
    assert 0 < count <= STEPS - 3 and len(computed) == STEPS - count
    assert computed[:2] == [0, 1] and computed[-1] == STEPS - 1  # no rate yet; the last step always computes
    assert member.steps == list(range(1, STEPS + 1))  # every step still reported
    drift = speed.latent_drift([latents(cached)], [latents(uncached)])
    assert 0 < drift < 0.02


def test_off_the_model_calls_its_network_every_step_and_reports_nothing(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = calls_of(monkeypatch)
    member = Member(job(2))
    engine(models_dir, threshold=0).sample_batch([member.member])
    assert len(calls) == STEPS and member.cached == []


def test_each_member_decides_alone_beside_others_at_other_steps(models_dir: Path) -> None:
    a, b, c = job(3, images=2), job(4, steps=12, guidance=1.0), job(5, steps=16)
    alone = {}
    for p in (a, b, c):
        member = Member(p)
        [result] = engine(models_dir).sample_batch([member.member])
        alone[p.seed] = (latents(result), member.cached)
    # c comes in at its step 6 beside a and b at 0, as it would resumed there.
    [stopped] = engine(models_dir).sample_batch([Member(c, suspend_at=6).member])
    assert isinstance(stopped, JobSuspended)
    members = [Member(a), Member(b), Member(c, resume=stopped.checkpoint)]
    results = engine(models_dir).sample_batch([m.member for m in members])
    for m, p, result in zip(members, (a, b, c), results, strict=True):
        assert (torch.equal(latents(result), alone[p.seed][0]), m.cached) == (True, alone[p.seed][1])


def test_a_fused_call_runs_only_the_rows_of_the_members_that_compute(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU's path on the CPU: members at other steps share a call; one that
    # reuses its prediction at a step is not in that step's call.
    a, b = job(6), job(7, steps=14)
    solo = {p.seed: latents(engine(models_dir).sample_batch([Member(p).member])[0]) for p in (a, b)}
    fused = engine(models_dir)
    denoiser = fused.denoisers[ModelFamily.TINY]
    denoiser.fuse_batches = True  # type: ignore[attr-defined]
    calls = calls_of(monkeypatch)
    members = [Member(a), Member(b)]
    results = fused.sample_batch([m.member for m in members])
    assert sum(len(call) for call in calls) == STEPS + 14 - sum(m.cached[0] for m in members)
    assert any(len(call) == 1 for call in calls[: 14 - 1])  # a step where only one of the two computed
    for p, result in zip((a, b), results, strict=True):
        torch.testing.assert_close(latents(result), solo[p.seed], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("suspend_at", [1, 7, 12])
def test_a_resumed_job_caches_as_it_would_have_uninterrupted(models_dir: Path, suspend_at: int) -> None:
    params = job(8, images=2)
    whole = Member(params)
    [uninterrupted] = engine(models_dir).sample_batch([whole.member])
    first = Member(params, suspend_at=suspend_at)
    [stopped] = engine(models_dir).sample_batch([first.member])
    assert isinstance(stopped, JobSuspended) and first.cached == []
    second = Member(params, resume=stopped.checkpoint)
    [resumed] = engine(models_dir).sample_batch([second.member])
    assert torch.equal(latents(resumed), latents(uninterrupted))
    assert second.cached == whole.cached and second.steps == list(range(suspend_at + 1, STEPS + 1))


def test_a_compiled_network_caching_steps_never_compiles_again(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fused, as on a GPU: the rows a step runs shrink as members reuse their
    # predictions, always to a bucket the model was warmed up with.
    import torch._dynamo

    torch._dynamo.reset()
    compilations = Compilations()
    monkeypatch.setattr(speed, "COMPILE_BACKEND", compilations)
    eng = engine(models_dir, compile=True, adapter_slots=0, default_width=64, default_height=64, max_batch=4)
    eng.denoisers[ModelFamily.TINY].fuse_batches = True  # type: ignore[attr-defined]
    eng.load("tiny")
    warmed = compilations.graphs
    members = [Member(job(9, images=2)), Member(job(10, steps=14)), Member(job(11, guidance=3.0))]
    results = eng.sample_batch([m.member for m in members])
    assert all(isinstance(r, torch.Tensor) for r in results) and all(m.cached[0] > 0 for m in members)
    assert compilations.graphs == warmed
    torch._dynamo.reset()


def test_the_change_is_the_largest_of_the_rows_relative_distances() -> None:
    before = torch.ones(2, 4)
    now = torch.tensor([[1.1] * 4, [1.3] * 4])
    assert float(relative_change(now, before)) == pytest.approx(0.3)


def test_aggressive_adds_step_caching_and_on_a_cpu_no_fp8() -> None:
    tiny = replace(ModelRegistry.load().get("tiny"), adapter_slots=0)
    plain = speed.SpeedOptions.of(replace(tiny, optimize=True), CPU)
    aggressive = speed.SpeedOptions.of(replace(tiny, optimize="aggressive"), CPU)
    assert plain.step_cache == 0 and aggressive == replace(plain, step_cache=speed.AGGRESSIVE_STEP_CACHE)
    assert speed.SpeedOptions.of(replace(tiny, optimize="aggressive", step_cache=0.05), CPU).step_cache == 0.05
    assert "step_cache=0.1" in aggressive.describe()


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('optimize = "fast"', 'optimize must be true, false or "aggressive"'),
        ("step_cache = -0.1", "step_cache must be a number within 0..1"),
        ("step_cache = 1.5", "step_cache must be a number within 0..1"),
        ("step_cache = true", "step_cache must be a number within 0..1"),
    ],
)
def test_the_registry_refuses_bad_speed_settings(tmp_path: Path, line: str, error: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(f'[models.m]\nsource = "builtin:tiny"\nfamily = "tiny"\n{line}\n')
    with pytest.raises(ModelError, match=error):
        ModelRegistry.load(path)


def test_the_registry_takes_aggressive_and_a_threshold(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models.m]\nsource = "builtin:tiny"\nfamily = "tiny"\noptimize = "aggressive"\nstep_cache = 0.2\n')
    spec = ModelRegistry.load(path).get("m")
    assert (spec.optimize, spec.step_cache) == ("aggressive", 0.2)
