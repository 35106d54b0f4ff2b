"""How a batch calls its denoising network when the network is compiled: padded to
a batch bucket, with its speed options around each call; and the warm-up that
compiles it, bucket by bucket, as the model loads rather than on a user's job."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from gpu_worker.denoising.checkpoint_capture import CheckpointPolicy, MemberCheckpoints
from gpu_worker.denoising.diffusers_run import WarmUpDenoiser
from gpu_worker.denoising.group_mesh import ShapeMesh
from gpu_worker.denoising.lockstep import ALONE, Lockstep
from gpu_worker.denoising.members import BatchMember
from gpu_worker.denoising.prompts import Conditioning
from services.generation import GenerationParams
from services.models import speed
from services.models.spec import ModelSpec

log = logging.getLogger(__name__)

# Steps of each warm-up generation of a compiled network (the second is what a
# multistep scheduler's later steps look like).
WARM_UP_STEPS = 2


@dataclass(frozen=True)
class NetworkCalls:
    """How a batch calls its (perhaps compiled) network: with its speed options, and
    padded to a bucket where it is compiled."""

    options: speed.SpeedOptions
    max_rows: int
    # A parallel model's group (its guidance halves split across ranks where its shape
    # says), and who decides its boundaries: the leader, for every rank.
    group: ShapeMesh | None = None
    lockstep: Lockstep = ALONE

    def padded(self, x: torch.Tensor, c: Conditioning) -> tuple[torch.Tensor, Conditioning]:
        """The network's input and conditioning padded to the bucket of their rows
        (``speed.padded``)."""
        padded = speed.padded(x, self.max_rows, self.options)
        return padded, c.padded(len(padded) - len(x)) if len(padded) > len(x) else c


def warm_up_buckets(denoiser: WarmUpDenoiser, pipe: Any, spec: ModelSpec, max_rows: int) -> float:
    """Runs the compiled network at the model's default size for each batch bucket
    up to ``max_rows``, with guidance and without: compiled now, not on a user's job.
    The seconds it took."""
    began = time.perf_counter()
    for rows in speed.buckets(max_rows):
        for guidance in sorted({spec.default_guidance, 1.0}):
            params = GenerationParams(
                spec.name,
                "warm-up",
                "",
                spec.default_width,
                spec.default_height,
                WARM_UP_STEPS,
                guidance,
                0,
                rows,
                frames=spec.default_frames,
                fps=spec.default_fps,
            )
            for prompt in denoiser.warm_up_prompts(params):
                warm_up = replace(params, prompt=prompt)
                inputs = denoiser.led_inputs(pipe, spec, warm_up, denoiser.warm_up_inputs(spec, warm_up))
                member = BatchMember(warm_up, _no_step, threading.Event(), inputs=inputs)
                checkpoints = MemberCheckpoints(denoiser.device, CheckpointPolicy())
                [run] = denoiser.denoise(pipe, spec, [member], checkpoints)
                if isinstance(run.result, BaseException):
                    raise run.result
    took = time.perf_counter() - began
    log.info("%s compiled and warmed up for batches of %s in %.1fs", spec.name, speed.buckets(max_rows), took)
    return took


def _no_step(step: int, total: int) -> None:
    pass
