"""The sim model family: the modelled time per step, latents from the seed, a fixed
projection to pixels; only ever a registry's explicit choice."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from gpu_worker.checkpoints import format as checkpoint_format
from gpu_worker.checkpoints.format import Checkpoint, CheckpointMismatch
from gpu_worker.denoising.members import BatchMember, JobSuspended
from gpu_worker.engine import SamplerEngine
from services.errors import ModelError
from services.generation import GenerationParams
from services.models import sim
from services.models.registry import ModelRegistry

BENCH_REGISTRY = Path(__file__).resolve().parents[2] / "bench" / "sim_registry.toml"


@dataclass(frozen=True)
class Job:
    width: int = 64
    height: int = 64
    seed: int = 7
    num_images: int = 2


def spec():
    return ModelRegistry.load(BENCH_REGISTRY).get("sim")


def test_a_step_takes_the_registry_s_time_scaled_by_pixels() -> None:
    # bench/sim_registry.toml: 640 ms a 512x512 step makes a 64x64 step 10 ms.
    assert sim.step_seconds(spec(), 64, 64) == pytest.approx(0.010)
    assert sim.step_seconds(spec(), 128, 64) == pytest.approx(0.020)


def test_the_steps_are_slept_and_reported_and_a_member_stops_at_its_next_step() -> None:
    stop_second = threading.Event()
    seen: list[tuple[int, int, int]] = []

    def on_step(member: int, step: int, total: int) -> None:
        seen.append((member, step, total))
        if step == 2:
            stop_second.set()

    began = time.perf_counter()
    ran = sim.sleep_steps(spec(), 64, 64, 4, [threading.Event(), stop_second], on_step)
    took = time.perf_counter() - began
    assert ran == [True, False]
    assert [s for s in seen if s[0] == 0] == [(0, n, 4) for n in (1, 2, 3, 4)]
    assert [s for s in seen if s[0] == 1] == [(1, 1, 4), (1, 2, 4)]  # it left after step 2
    assert took >= 4 * 0.010  # never less than the modelled time


def test_latents_come_from_the_seed_and_decode_to_pixels_of_the_size() -> None:
    a, b = sim.latents(Job()), sim.latents(Job())
    assert a.shape == (2, 4, 8, 8) and torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # each image its own seed
    assert not torch.equal(a, sim.latents(Job(seed=8)))
    pixels = sim.decode(a)
    assert pixels.shape == (2, 3, 64, 64)
    assert float(pixels.min()) >= -1 and float(pixels.max()) <= 1 and float(pixels.std()) > 0.05


def test_sim_is_a_registry_s_explicit_choice(tmp_path: Path) -> None:
    assert all(s.family != "sim" for s in ModelRegistry.load().models.values())  # never in the default one
    bad = tmp_path / "registry.toml"
    bad.write_text('[models.fake]\nsource = "/models/sd15"\nfamily = "sim"\n')
    with pytest.raises(ModelError, match="sim family"):
        ModelRegistry.load(bad)
    bad.write_text('[models.fake]\nsource = "builtin:sim"\nfamily = "sd15"\n')
    with pytest.raises(ModelError, match="sim family"):
        ModelRegistry.load(bad)


def test_each_member_starts_at_its_own_step() -> None:
    seen: list[tuple[int, int, int]] = []
    ran = sim.sleep_steps(spec(), 64, 64, 4, [threading.Event(), threading.Event()], _append(seen), start=[2, 0])
    assert ran == [True, True]
    assert [s for s in seen if s[0] == 0] == [(0, 3, 4), (0, 4, 4)]
    assert [s for s in seen if s[0] == 1] == [(1, n, 4) for n in (1, 2, 3, 4)]
    with pytest.raises(ValueError, match="start steps"):
        sim.sleep_steps(spec(), 64, 64, 4, [threading.Event()], _append(seen), start=[5])


def _append(seen: list[tuple[int, int, int]]) -> Callable[[int, int, int], None]:
    return lambda member, step, total: seen.append((member, step, total))


def test_a_suspended_sim_job_resumes_at_its_step_to_the_same_latents(tmp_path: Path) -> None:
    request = GenerationParams("sim", "p", "", 64, 64, 5, 7.5, 3, 2)
    stopping = threading.Event()
    steps: list[int] = []

    def on_step(step: int, total: int) -> None:
        steps.append(step)
        if step == 2:
            stopping.set()

    registry = ModelRegistry.load(BENCH_REGISTRY)
    other = BatchMember(replace(request, seed=4), lambda step, total: None, threading.Event())
    first = SamplerEngine(registry, tmp_path, torch.device("cpu"))
    leaving, staying = first.sample_batch([BatchMember(request, on_step, stopping, suspend=lambda: True), other])
    assert isinstance(leaving, JobSuspended) and (leaving.checkpoint.step, leaving.checkpoint.total) == (2, 5)
    assert isinstance(staying, torch.Tensor) and torch.equal(staying, sim.latents(other.params))
    assert steps == [1, 2]

    steps.clear()
    resumed = BatchMember(request, lambda step, total: steps.append(step), threading.Event(), resume=leaving.checkpoint)
    [result] = SamplerEngine(registry, tmp_path, torch.device("cpu")).sample_batch([resumed])
    assert isinstance(result, torch.Tensor) and torch.equal(result, sim.latents(request))
    assert steps == [3, 4, 5]


def test_a_sim_job_checkpoints_by_the_registry_s_policy(tmp_path: Path) -> None:
    registry = ModelRegistry({"sim": replace(spec(), checkpoint_every_steps=2)})
    taken: list[Checkpoint] = []
    request = GenerationParams("sim", "p", "", 64, 64, 5, 7.5, 3, 1)
    member = BatchMember(request, lambda step, total: None, threading.Event(), on_checkpoint=taken.append)
    SamplerEngine(registry, tmp_path, torch.device("cpu")).sample_batch([member])
    assert [c.step for c in taken] == [2, 4]
    fingerprint = checkpoint_format.fingerprint(request, "")
    assert checkpoint_format.restore(taken[0], fingerprint, torch.device("cpu")) is None  # the step is all it holds
    with pytest.raises(CheckpointMismatch):
        checkpoint_format.restore(
            taken[0], checkpoint_format.fingerprint(replace(request, seed=4), ""), torch.device("cpu")
        )
