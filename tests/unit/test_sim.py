"""The sim model family: the modelled time per step, latents from the seed, a fixed
projection to pixels; only ever a registry's explicit choice."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.errors import ModelError
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
