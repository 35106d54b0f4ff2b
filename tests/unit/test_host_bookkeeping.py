"""What the sampler's loop reads on the host for each job, made once and reused: a
job's noise scheduler is a copy of one made from the pipeline's config (the same
state as a fresh one, and independent of the others), and a network's dtype is read
once per network until its speed options are applied."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from gpu_worker.denoising.noise_schedulers import host_scheduler
from services.generation import GenerationParams
from services.models import speed
from services.models.device import module_dtype


def params(steps: int) -> GenerationParams:
    return GenerationParams("tiny", "a lighthouse", "", 64, 64, steps, 7.5, 0, 1)


@pytest.mark.parametrize("cls", [EulerDiscreteScheduler, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler])
def test_a_jobs_scheduler_is_a_fresh_one_of_its_own(cls: Any) -> None:
    pipe = SimpleNamespace(scheduler=EulerDiscreteScheduler(beta_schedule="scaled_linear"))
    first = host_scheduler(cls, pipe, params(7))
    fresh = cls.from_config(pipe.scheduler.config)
    fresh.set_timesteps(7, device="cpu")
    assert torch.equal(first.timesteps, fresh.timesteps)
    assert torch.equal(first.sigmas, fresh.sigmas)
    assert dict(first.config) == dict(fresh.config)
    # Stepping one job's scheduler leaves the next job's as new.
    x = torch.zeros(1, 4, 8, 8)
    first.step(torch.ones_like(x), first.timesteps[0], x)
    second = host_scheduler(cls, pipe, params(7))
    assert second is not first
    assert second.step_index is None
    assert first.step_index == 1
    assert torch.equal(second.timesteps, fresh.timesteps)
    assert len(host_scheduler(cls, pipe, params(3)).timesteps) == 3


class Counted(torch.nn.Module):
    """A network whose dtype reads are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.reads = 0

    @property
    def dtype(self) -> torch.dtype:
        self.reads += 1
        return next(self.parameters()).dtype


def test_a_networks_dtype_is_read_once_until_its_options_cast_it() -> None:
    network = Counted()
    assert [module_dtype(network) for _ in range(5)] == [torch.float32] * 5
    assert network.reads == 1
    # Applying speed options may cast it in place: it is read afresh after.
    prepared = speed.prepare(network, speed.SpeedOptions())
    prepared.to(torch.bfloat16)
    assert module_dtype(prepared) == torch.bfloat16
    assert network.reads == 2
    assert module_dtype(Counted()) == torch.float32  # another network: its own read
