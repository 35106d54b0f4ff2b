"""Continuous batching in the sampler's loop, on the CPU with the tiny model: members
of one model and size with other steps, guidance and seeds share a batch; a job
offered while a batch runs joins it at the next step boundary, leaves as soon as its
own steps are done, and its latents are exactly its solo latents; a joined member
suspends and resumes as any other; a batch takes no one past its room or once it
has ended."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.members import BatchMember, JobSuspended, MemberResult
from gpu_worker.denoising.running_batch import Cohort, RunningBatch
from gpu_worker.engine import SamplerEngine
from services.generation import GenerationParams
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily


def params(seed: int, steps: int = 6, guidance: float = 7.5, images: int = 1, width: int = 64) -> GenerationParams:
    return GenerationParams("tiny", f"a lighthouse {seed}", "", width, 64, steps, guidance, seed, images)


def member(
    p: GenerationParams,
    on_step: Callable[[int, int], None] = lambda step, total: None,
    stopping: threading.Event | None = None,
    **extra: object,
) -> BatchMember:
    return BatchMember(p, on_step, stopping or threading.Event(), **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(models_dir: Path) -> SamplerEngine:
    return SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))


def solo(engine: SamplerEngine, p: GenerationParams) -> torch.Tensor:
    return engine.sample(p, lambda step, total: None, threading.Event())


class Departures:
    """What left a running batch, boundary by boundary."""

    def __init__(self) -> None:
        self.cohorts: list[list[tuple[str, MemberResult]]] = []

    def __call__(self, cohort: Cohort) -> None:
        self.cohorts.append([(m.params.prompt, result) for m, result in cohort])

    def of(self, prompt: str) -> MemberResult:
        return next(r for c in self.cohorts for p, r in c if p == prompt)


def test_members_of_other_steps_and_guidance_each_get_their_solo_latents(engine: SamplerEngine) -> None:
    mixed = [params(1, steps=4), params(2, steps=8, guidance=3.0), params(3, steps=6, guidance=1.0, images=2)]
    left = Departures()
    batch = RunningBatch(mixed[0].join_key, 8, [member(p) for p in mixed], left)
    results = engine.sample_batch([member(p) for p in mixed], batch)
    for p, result in zip(mixed, results, strict=True):
        assert isinstance(result, torch.Tensor)
        assert torch.equal(result, solo(engine, p)), p
    # Each left at the boundary its own steps ended at, the shortest first.
    assert [[prompt for prompt, _ in c] for c in left.cohorts] == [
        ["a lighthouse 1"],
        ["a lighthouse 3"],
        ["a lighthouse 2"],
    ]


def test_a_job_offered_mid_batch_joins_at_the_next_step_and_leaves_when_done(engine: SamplerEngine) -> None:
    running, late = params(10, steps=10), params(11, steps=3, guidance=5.0)
    left = Departures()
    batch = RunningBatch(running.join_key, 8, [], left)
    batch_step = [0]
    late_steps: list[tuple[int, int]] = []  # (its step, the batch's step in the same round)

    def on_step(step: int, total: int) -> None:
        batch_step[0] = step
        if step == 2:
            offered = member(late, lambda s, t: late_steps.append((s, batch_step[0])))
            assert batch.offer([offered]) == 1

    first = member(running, on_step)
    batch = RunningBatch(running.join_key, 8, [first], left)
    results = engine.sample_batch([first], batch)
    # Offered after the batch's step 2: its steps 1-3 ran beside the batch's 3-5.
    assert late_steps == [(1, 3), (2, 4), (3, 5)]
    # It left after its 3 steps, while the batch went on with its 10.
    assert [[prompt for prompt, _ in c] for c in left.cohorts] == [["a lighthouse 11"], ["a lighthouse 10"]]
    joined = left.of("a lighthouse 11")
    assert isinstance(joined, torch.Tensor) and torch.equal(joined, solo(engine, late))
    assert len(results) == 2 and isinstance(results[0], torch.Tensor) and torch.equal(results[0], solo(engine, running))
    assert batch.offer([member(late)]) is None, "an ended batch takes no one"


def test_a_joined_member_suspends_and_resumes_to_its_solo_latents(engine: SamplerEngine) -> None:
    running, late = params(20, steps=10), params(21, steps=6)
    stop = threading.Event()
    left = Departures()

    def late_step(step: int, total: int) -> None:
        if step == 2:
            stop.set()

    def on_step(step: int, total: int) -> None:
        if step == 1:
            batch.offer([member(late, late_step, stop, suspend=lambda: True)])

    first = member(running, on_step)
    batch = RunningBatch(running.join_key, 8, [first], left)
    engine.sample_batch([first], batch)
    suspended = left.of("a lighthouse 21")
    assert isinstance(suspended, JobSuspended) and suspended.checkpoint.step == 2
    resumed = engine.sample_batch([member(late, resume=suspended.checkpoint)])[0]
    assert isinstance(resumed, torch.Tensor) and torch.equal(resumed, solo(engine, late))


def test_a_batch_takes_no_one_past_its_room_nor_of_another_size() -> None:
    running = params(1, images=2)
    batch = RunningBatch(running.join_key, 4, [member(running)], lambda cohort: None)
    assert batch.seats() is None, "its model loading: no room to offer yet"
    batch.begin()
    assert batch.offer([member(params(2, images=3))]) is None, "2 + 3 images > 4"
    assert batch.offer([member(params(3, width=96))]) is None, "another size"
    assert batch.offer([member(params(4, images=2))]) == 2
    assert batch.seats() is None, "full"
    assert [m.params.seed for m in batch.joining()] == [4]
    batch.leave([(member(running), torch.zeros(1))])
    seats = batch.seats()
    assert seats is not None and (seats.rows, seats.free_rows) == (2, 2)
    assert batch.close() == [] and batch.offer([member(params(5))]) is None


def test_what_is_offered_as_the_loop_ends_joins_rather_than_being_lost() -> None:
    running = params(1)
    batch = RunningBatch(running.join_key, 4, [member(running)], lambda cohort: None)
    assert batch.offer([member(params(2))]) == 1
    # The loop has no member left: closing hands back what was offered meanwhile.
    assert [m.params.seed for m in batch.close()] == [2]
    assert batch.offer([member(params(3))]) is not None, "still open: the loop goes on"
    assert [m.params.seed for m in batch.close()] == [3]
    assert batch.close() == []
    assert batch.offer([member(params(4))]) is None


def test_guidance_and_steps_are_not_part_of_the_join_key() -> None:
    assert params(1, steps=4, guidance=2.0).join_key == replace(params(2), seed=9).join_key


def test_on_the_gpus_path_one_call_of_other_steps_and_guidance_gives_each_its_solo_latents(
    engine: SamplerEngine, models_dir: Path
) -> None:
    # A GPU fuses the members' calls, each row at its own timestep and guidance scale;
    # on the CPU that path's arithmetic differs from a solo call's in the last bits.
    fused = SamplerEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))
    denoiser = fused.denoisers[ModelFamily.TINY]
    assert isinstance(denoiser, DiffusersDenoiser)
    denoiser.fuse_batches = True
    mixed = [params(31, steps=5), params(32, steps=8, guidance=3.0, images=2), params(33, steps=6, guidance=1.0)]
    late = params(34, steps=4, guidance=9.0)

    def on_step(step: int, total: int) -> None:
        if step == 2:
            batch.offer([member(late)])

    members = [member(mixed[0], on_step), *(member(p) for p in mixed[1:])]
    batch = RunningBatch(late.join_key, 8, members, lambda cohort: None)
    results = fused.sample_batch(members, batch)
    for p, result in zip([*mixed, late], results, strict=True):
        assert isinstance(result, torch.Tensor)
        torch.testing.assert_close(result, solo(engine, p), rtol=1e-4, atol=1e-4)
