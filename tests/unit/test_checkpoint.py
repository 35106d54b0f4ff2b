"""Suspending a denoising job at a step boundary and resuming it elsewhere gives
exactly the uninterrupted image on the CPU: for deterministic, stochastic and
multistep noise schedulers, alone and in a batch, from a suspension or a periodic
checkpoint; a checkpoint of another job is refused and the job runs from step 0."""

from __future__ import annotations

import io
import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpu_worker.checkpoints import format as checkpoint_format
from gpu_worker.checkpoints.format import Checkpoint, CheckpointMismatch, Snapshot
from gpu_worker.denoising import diffusers_denoiser
from gpu_worker.denoising.checkpoint_capture import CheckpointPolicy
from gpu_worker.denoising.members import BatchMember, JobSuspended
from gpu_worker.engine import SamplerEngine
from gpu_worker.families.unet import UNetDenoiser
from services.errors import JobInterrupted, ModelError
from services.generation import GenerationParams
from services.models.registry import ModelRegistry
from services.models.spec import ModelFamily

STEPS = 6
CPU = torch.device("cpu")
# The tiny model's own (Euler), a deterministic one, a stochastic one, multistep ones.
SCHEDULERS = [
    "",
    "DDIMScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "UniPCMultistepScheduler",
    "PNDMScheduler",
]


def registry(scheduler: str = "", every_steps: int = 0, every_s: float = 0.0) -> ModelRegistry:
    tiny = ModelRegistry.load().get("tiny")
    spec = replace(tiny, scheduler=scheduler, checkpoint_every_steps=every_steps, checkpoint_every_s=every_s)
    return ModelRegistry({"tiny": spec})


def engine(models_dir: Path, scheduler: str = "", every_steps: int = 0, every_s: float = 0.0) -> SamplerEngine:
    """A new engine each time: a resume in one is what another process would do."""
    return SamplerEngine(registry(scheduler, every_steps, every_s), models_dir, CPU)


def job(seed: int, images: int = 1, prompt: str = "a lighthouse", steps: int = STEPS) -> GenerationParams:
    return GenerationParams("tiny", prompt, "", 64, 64, steps, 7.5, seed, images)


class Member:
    """A batch member that records its steps and checkpoints, and is suspended once
    ``suspend_at`` steps are done (as a suspension arriving during the next would)."""

    def __init__(self, req: GenerationParams, suspend_at: int = 0, resume: Checkpoint | None = None) -> None:
        self.steps: list[int] = []
        self.checkpoints: list[Checkpoint] = []
        self.stopping = threading.Event()
        self.suspend_at = suspend_at
        self.member = BatchMember(
            req, self.on_step, self.stopping, resume=resume, on_checkpoint=self.checkpoints.append, suspend=lambda: True
        )

    def on_step(self, step: int, total: int) -> None:
        self.steps.append(step)
        if step == self.suspend_at:
            self.stopping.set()


def run(eng: SamplerEngine, *members: Member) -> list[torch.Tensor | BaseException]:
    return eng.sample_batch([m.member for m in members])


def latents(result: torch.Tensor | BaseException) -> torch.Tensor:
    assert isinstance(result, torch.Tensor), result
    return result


def suspended(result: torch.Tensor | BaseException) -> Checkpoint:
    assert isinstance(result, JobSuspended), result
    return result.checkpoint


def uninterrupted(models_dir: Path, req: GenerationParams, scheduler: str = "") -> torch.Tensor:
    [result] = run(engine(models_dir, scheduler), Member(req))
    return latents(result)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_resumed_job_gets_exactly_its_uninterrupted_latents(models_dir: Path, scheduler: str) -> None:
    req = job(11, images=2)
    whole = uninterrupted(models_dir, req, scheduler)
    first = Member(req, suspend_at=3)
    [result] = run(engine(models_dir, scheduler), first)
    ckpt = suspended(result)
    total = ckpt.total  # the scheduler's timesteps: more than the steps for PNDM
    assert (ckpt.step, first.steps) == (3, [1, 2, 3]) and total >= STEPS
    second = Member(req, resume=ckpt)
    [result] = run(engine(models_dir, scheduler), second)
    assert torch.equal(latents(result), whole)
    assert second.steps == list(range(4, total + 1))


def test_the_scheduler_can_be_chosen_and_changes_the_image(models_dir: Path) -> None:
    # Else the schedulers above would all be the model's own, and prove little.
    req = job(11)
    images = [uninterrupted(models_dir, req, s) for s in ("", "DDIMScheduler", "EulerAncestralDiscreteScheduler")]
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])
    [result] = run(engine(models_dir, "DPMSolverMultistepScheduler"), Member(req, suspend_at=2))
    fingerprint = checkpoint_format.fingerprint(req, "DPMSolverMultistepScheduler")
    assert checkpoint_format.restore(suspended(result), fingerprint, CPU) is not None  # it names the class it ran


@pytest.mark.parametrize("scheduler", ["DPMSolverMultistepScheduler", "EulerAncestralDiscreteScheduler"])
def test_a_suspended_member_leaves_its_batch_and_resumes_beside_a_fresh_job(models_dir: Path, scheduler: str) -> None:
    leaving, staying, fresh = job(21, images=2), job(22, prompt="a harbour"), job(23)
    alone = {r.seed: uninterrupted(models_dir, r, scheduler) for r in (leaving, staying, fresh)}

    first, other = Member(leaving, suspend_at=2), Member(staying)
    results = run(engine(models_dir, scheduler), first, other)
    ckpt = suspended(results[0])
    assert first.steps == [1, 2] and other.steps == list(range(1, STEPS + 1))
    assert torch.equal(latents(results[1]), alone[staying.seed])

    resumed, beside = Member(leaving, resume=ckpt), Member(fresh)
    results = run(engine(models_dir, scheduler), resumed, beside)
    assert torch.equal(latents(results[0]), alone[leaving.seed])
    assert torch.equal(latents(results[1]), alone[fresh.seed])
    assert resumed.steps == list(range(3, STEPS + 1)) and beside.steps == list(range(1, STEPS + 1))


def test_fused_batches_share_one_unet_call_at_different_steps(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU's path, on the CPU: a fused call's arithmetic differs in the last bits,
    # so the images are close, not equal. Members at other steps share the call, each
    # row at its own timestep.
    scheduler = "DPMSolverMultistepScheduler"
    a, b = job(31), job(32)
    eng = engine(models_dir, scheduler)
    [result] = run(eng, Member(a, suspend_at=2))
    ckpt = suspended(result)
    fused = engine(models_dir, scheduler)
    denoiser = fused.denoisers[ModelFamily.TINY]
    assert isinstance(denoiser, UNetDenoiser)
    denoiser.fuse_batches = True
    calls: list[list[int]] = []
    predict = diffusers_denoiser.guided_noise

    def spy(denoiser: Any, pipe: Any, group: list[Any], *args: Any) -> list[torch.Tensor]:
        calls.append([r.step for r in group])
        return predict(denoiser, pipe, group, *args)

    monkeypatch.setattr(diffusers_denoiser, "guided_noise", spy)
    results = run(fused, Member(a, resume=ckpt), Member(b))
    # The resumed member at steps 2-5 beside the fresh one at 0-3, in one call a round.
    assert calls == [[2, 0], [3, 1], [4, 2], [5, 3], [4], [5]]
    calls.clear()
    run(fused, Member(a), Member(b))
    assert calls == [[s, s] for s in range(STEPS)]
    torch.testing.assert_close(latents(results[0]), uninterrupted(models_dir, a, scheduler), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(latents(results[1]), uninterrupted(models_dir, b, scheduler), rtol=1e-4, atol=1e-4)


def test_periodic_checkpoints_come_every_n_steps_and_resume_exactly(models_dir: Path) -> None:
    scheduler = "EulerAncestralDiscreteScheduler"
    req = job(41, steps=10)
    whole = uninterrupted(models_dir, req, scheduler)
    watched = Member(req)
    [result] = run(engine(models_dir, scheduler, every_steps=3), watched)
    assert torch.equal(latents(result), whole)  # taking checkpoints changes nothing
    assert [c.step for c in watched.checkpoints] == [3, 6, 9]
    assert all(c.total == 10 for c in watched.checkpoints)
    resumed = Member(req, resume=watched.checkpoints[1])
    [result] = run(engine(models_dir, scheduler, every_steps=3), resumed)
    assert torch.equal(latents(result), whole)
    assert resumed.steps == [7, 8, 9, 10]
    assert [c.step for c in resumed.checkpoints] == [9]  # counted from the resume


def test_periodic_checkpoints_by_time_skip_only_the_last_step(models_dir: Path) -> None:
    watched = Member(job(42))
    run(engine(models_dir, every_s=1e-9), watched)
    assert [c.step for c in watched.checkpoints] == list(range(1, STEPS))
    unwatched = Member(job(42))
    run(engine(models_dir), unwatched)
    assert unwatched.checkpoints == []  # no policy, no checkpoint


def test_a_checkpoint_of_another_job_is_refused_and_the_job_runs_from_step_0(
    models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = "DPMSolverMultistepScheduler"
    mine, theirs = job(51), job(52)
    [result] = run(engine(models_dir, scheduler), Member(theirs, suspend_at=3))
    foreign = suspended(result)
    with pytest.raises(CheckpointMismatch, match="seed"):
        checkpoint_format.restore(foreign, checkpoint_format.fingerprint(mine, scheduler), CPU)
    with pytest.raises(CheckpointMismatch, match="scheduler"):
        checkpoint_format.restore(foreign, checkpoint_format.fingerprint(theirs, "DDIMScheduler"), CPU)
    corrupt = replace(foreign, data=foreign.data[: len(foreign.data) // 2])
    with pytest.raises(CheckpointMismatch, match="cannot be read"):
        checkpoint_format.restore(corrupt, checkpoint_format.fingerprint(theirs, scheduler), CPU)
    with pytest.raises(CheckpointMismatch, match="step"):
        checkpoint_format.restore(replace(foreign, step=2), checkpoint_format.fingerprint(theirs, scheduler), CPU)

    whole = uninterrupted(models_dir, mine, scheduler)
    for bad in (foreign, corrupt):
        given = Member(mine, resume=bad)
        with caplog.at_level(logging.WARNING, logger="gpu_worker.denoising.checkpoint_capture"):
            [result] = run(engine(models_dir, scheduler), given)
        assert torch.equal(latents(result), whole)
        assert given.steps == list(range(1, STEPS + 1))
        assert "runs from step 0" in caplog.text
        caplog.clear()


def test_a_checkpoint_this_engine_cannot_continue_is_refused(models_dir: Path) -> None:
    scheduler = "EulerAncestralDiscreteScheduler"
    req = job(53, images=2)
    [result] = run(engine(models_dir, scheduler), Member(req, suspend_at=2))
    ckpt = suspended(result)
    fingerprint = checkpoint_format.fingerprint(req, scheduler)
    snapshot = checkpoint_format.restore(ckpt, fingerprint, CPU)
    assert snapshot is not None
    whole = uninterrupted(models_dir, req, scheduler)
    unfit = [
        replace(snapshot, device_type="cuda"),  # a CUDA generator's state, a GPU's arithmetic
        replace(snapshot, latents=snapshot.latents.half()),
        # The first image's generator is restored before the second's is found
        # wrong: the job must still start from fresh generators.
        replace(snapshot, generators=[snapshot.generators[0], torch.zeros(3, dtype=torch.uint8)]),
    ]
    for bad in unfit:
        given = Member(req, resume=checkpoint_format.capture(ckpt.step, ckpt.total, fingerprint, bad))
        [result] = run(engine(models_dir, scheduler), given)
        assert torch.equal(latents(result), whole)
        assert given.steps == list(range(1, STEPS + 1))


_unpickled: list[str] = []


def _record_unpickling() -> str:
    _unpickled.append("ran")
    return "ran"


class _Trap:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_record_unpickling, ())


def test_checkpoint_bytes_never_run_code() -> None:
    buffer = io.BytesIO()
    torch.save({"format": checkpoint_format.FORMAT, "trap": _Trap()}, buffer)
    with pytest.raises(CheckpointMismatch, match="cannot be read"):
        checkpoint_format.restore(
            Checkpoint(0, STEPS, buffer.getvalue()), checkpoint_format.fingerprint(job(1), ""), CPU
        )
    assert _unpickled == []


def test_a_member_stopped_before_any_step_hands_back_where_it_would_start(models_dir: Path) -> None:
    req = job(61)
    stopped = Member(req)
    stopped.stopping.set()
    [result] = run(engine(models_dir), stopped)
    start = suspended(result)
    assert (start.step, start.total, stopped.steps) == (0, STEPS, [])
    resumed = Member(req, resume=start)
    [result] = run(engine(models_dir), resumed)
    assert torch.equal(latents(result), uninterrupted(models_dir, req))
    assert resumed.steps == list(range(1, STEPS + 1))

    [result] = run(engine(models_dir), Member(req, suspend_at=4))
    ckpt = suspended(result)
    again = Member(req, resume=ckpt)
    again.stopping.set()
    [result] = run(engine(models_dir), again)
    assert suspended(result) is ckpt  # nothing ran: the same checkpoint


def test_without_suspend_a_stopped_member_is_interrupted_as_before(models_dir: Path) -> None:
    stopping = threading.Event()
    steps: list[int] = []

    def on_step(step: int, total: int) -> None:
        steps.append(step)
        stopping.set()

    [result] = engine(models_dir).sample_batch([BatchMember(job(62), on_step, stopping)])
    assert type(result) is JobInterrupted
    assert steps == [1]


def test_a_checkpoint_of_the_last_step_leaves_nothing_to_run(models_dir: Path) -> None:
    req = job(63)
    whole = uninterrupted(models_dir, req)
    generator = torch.Generator().manual_seed(req.seed)
    fingerprint = checkpoint_format.fingerprint(req, "EulerDiscreteScheduler")
    done = checkpoint_format.capture(STEPS, STEPS, fingerprint, Snapshot(whole, [generator.get_state()], {}, (), "cpu"))
    resumed = Member(req, resume=done)
    [result] = run(engine(models_dir), resumed)
    assert torch.equal(latents(result), whole)
    assert resumed.steps == []


def test_scheduler_values_of_every_kind_come_back_as_they_were() -> None:
    state = {
        "array": np.arange(4, dtype=np.int64),
        "scalar": np.float32(0.25),
        "nested": (1, [2.5, None, "x", True], {"k": torch.ones(2, dtype=torch.float16)}),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
    }
    latents_ = torch.randn(1, 4, 8, 8)
    fingerprint = checkpoint_format.fingerprint(job(1), "X")
    data = checkpoint_format.capture(2, 6, fingerprint, Snapshot(latents_, [], state, ("gone",), "cpu"))
    back = checkpoint_format.restore(data, fingerprint, CPU)
    assert back is not None and back.removed == ("gone",) and torch.equal(back.latents, latents_)
    assert back.scheduler["array"].dtype == np.int64 and np.array_equal(back.scheduler["array"], np.arange(4))
    assert type(back.scheduler["scalar"]) is np.float32 and back.scheduler["scalar"] == np.float32(0.25)
    one, values, inner = back.scheduler["nested"]
    assert (one, values) == (1, [2.5, None, "x", True])
    assert inner["k"].dtype == torch.float16 and torch.equal(inner["k"], torch.ones(2, dtype=torch.float16))
    assert (back.scheduler["dtype"], back.scheduler["device"]) == (torch.bfloat16, CPU)
    with pytest.raises(TypeError, match="cannot checkpoint"):
        checkpoint_format.capture(2, 6, fingerprint, Snapshot(latents_, [], {"lock": threading.Lock()}, (), "cpu"))


def test_only_what_differs_from_a_fresh_scheduler_is_kept() -> None:
    from diffusers import DPMSolverMultistepScheduler

    solver: Any = DPMSolverMultistepScheduler  # diffusers' lazy module hides its attributes from mypy
    fresh = solver()
    fresh.set_timesteps(STEPS)
    live = solver()
    live.set_timesteps(STEPS)
    assert checkpoint_format.scheduler_state(live, fresh) == ({}, ())
    sample = torch.randn(1, 4, 8, 8)
    live.step(torch.randn(1, 4, 8, 8), live.timesteps[0], sample)
    live.sigmas[0] += 1  # changed in place: kept too
    changed, removed = checkpoint_format.scheduler_state(live, fresh)
    assert {"model_outputs", "lower_order_nums", "_step_index", "sigmas"} <= set(changed)
    assert "betas" not in changed and "alphas_cumprod" not in changed and removed == ()


def test_the_policy_is_due_after_enough_steps_or_seconds() -> None:
    never = CheckpointPolicy()
    assert not never.due(1000, 1e6)
    steps = CheckpointPolicy(every_steps=3)
    assert [steps.due(n, 1e6) for n in (0, 2, 3, 4)] == [False, False, True, True]
    seconds = CheckpointPolicy(every_s=2.0)
    assert [seconds.due(1000, s) for s in (0.0, 1.9, 2.0)] == [False, False, True]
    both = CheckpointPolicy(every_steps=5, every_s=2.0)
    assert (both.due(5, 0.0), both.due(1, 2.0), both.due(4, 1.9)) == (True, True, False)
    with pytest.raises(ValueError):
        CheckpointPolicy(every_steps=-1)
    with pytest.raises(ValueError):
        CheckpointPolicy(every_s=float("nan"))


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("checkpoint_every_steps = -1", "'bad': checkpoint_every_steps must be a whole number >= 0, not -1"),
        ("checkpoint_every_steps = 2.5", "'bad': checkpoint_every_steps must be a whole number >= 0"),
        ("checkpoint_every_s = -0.5", "'bad': checkpoint_every_s must be a number >= 0, not -0.5"),
        ("checkpoint_every_s = nan", "'bad': checkpoint_every_s must be a number >= 0"),
        ('scheduler = "NoSuchScheduler"', "'bad': scheduler 'NoSuchScheduler' is not a diffusers noise scheduler"),
        ('scheduler = "UNet2DConditionModel"', "'bad': scheduler 'UNet2DConditionModel' is not a diffusers"),
    ],
)
def test_the_registry_refuses_bad_checkpoint_and_scheduler_settings(tmp_path: Path, line: str, error: str) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(f'[models.bad]\nsource = "builtin:tiny"\nfamily = "tiny"\n{line}\n')
    with pytest.raises(ModelError) as raised:
        ModelRegistry.load(path)
    assert error in str(raised.value)


def test_the_registry_takes_good_checkpoint_and_scheduler_settings(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(
        '[models.good]\nsource = "builtin:tiny"\nfamily = "tiny"\nscheduler = "DPMSolverMultistepScheduler"\n'
        "checkpoint_every_steps = 5\ncheckpoint_every_s = 30\n"
    )
    spec = ModelRegistry.load(path).get("good")
    assert (spec.scheduler, spec.checkpoint_every_steps, spec.checkpoint_every_s) == (
        "DPMSolverMultistepScheduler",
        5,
        30,
    )
    default = ModelRegistry.load().get("tiny")
    assert (default.scheduler, default.checkpoint_every_steps, default.checkpoint_every_s) == ("", 0, 10.0)
