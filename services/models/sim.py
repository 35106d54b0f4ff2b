"""The ``sim`` family: a model that costs only the time the registry says it takes.

It exists for control-plane benchmarks and scheduler experiments (``bench/``), and
never stands in for a real model anywhere else: nothing in the default registry is a
``sim`` model. A sim sampler sleeps for the modelled duration of each step (the
registry's ``step_ms_512``, scaled by pixels, as the scheduler's first estimates
are) and returns small latents drawn from the job's seed; a sim decoder turns
latents into pixels with a fixed projection, so the real decoder path (batching,
output checks, encoding, streaming) runs on them at almost no cost. A sim model
may name a picture (``ModelSpec.sim_image``): its latents are then that picture's,
the same for every seed, so that tests can have a known output go through the
whole stack (the image filter's, tests/fixtures/flagged.png)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from services.models.spec import ModelSpec

LATENT_CHANNELS = 4
# Pixels per latent along each side, as SD's VAEs.
SCALE = 8
# Latent channels to RGB: a fixed map, so that a latent's image is always the same.
_TO_RGB = torch.tensor(
    [[0.30, 0.19, 0.21], [0.19, 0.29, 0.17], [-0.16, 0.19, 0.26], [-0.18, -0.27, -0.47]], dtype=torch.float32
)


class SimJob(Protocol):
    @property
    def width(self) -> int: ...

    @property
    def height(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def num_images(self) -> int: ...


def step_seconds(spec: ModelSpec, width: int, height: int) -> float:
    """How long one denoising step of a batch at this size is modelled to take.
    A batch costs what one image does: at the sizes sim jobs run at, a GPU is
    bound by latency, not arithmetic."""
    return spec.step_s_512 * width * height / (512 * 512)


def latents(job: SimJob, image: str = "") -> torch.Tensor:
    """The job's latents, (num_images, 4, height/8, width/8), drawn from its seeds;
    or, given a picture's path, the picture's (``image_latents``) for each image."""
    if image:
        return image_latents(image, job.width, job.height).expand(job.num_images, -1, -1, -1).clone()
    out = []
    for i in range(job.num_images):
        generator = torch.Generator().manual_seed((job.seed + i) % 2**63)
        out.append(torch.randn(1, LATENT_CHANNELS, job.height // SCALE, job.width // SCALE, generator=generator))
    return torch.cat(out)


def sleep_steps(
    spec: ModelSpec,
    width: int,
    height: int,
    steps: int,
    stopping: Sequence[threading.Event],
    on_step: Callable[[int, int, int], None],
    start: Sequence[int] | None = None,
) -> list[bool]:
    """Sleeps through the modelled steps of a batch of members, each with its own
    ``stopping`` and its own first step (``start``, default 0: a resumed member
    starts where its checkpoint was taken); calls ``on_step(member, step, total)``
    after each step for the members still running. Returns, per member, whether it
    ran every step. A sim job's latents come from its seeds, so its step is its
    whole state: the caller checkpoints it from what ``on_step`` reported."""
    done = list(start) if start is not None else [0] * len(stopping)
    if len(done) != len(stopping) or not all(0 <= s <= steps for s in done):
        raise ValueError(f"start steps {done} do not fit {len(stopping)} members of {steps} steps")
    per_step = step_seconds(spec, width, height)
    running = [True] * len(stopping)
    deadline = time.perf_counter()
    while True:
        for i, event in enumerate(stopping):
            if running[i] and done[i] < steps and event.is_set():
                running[i] = False
        stepping = [i for i in range(len(stopping)) if running[i] and done[i] < steps]
        if not stepping:
            break
        # Against a deadline, so that the sleeps' own overshoot does not add up.
        deadline += per_step
        pause = deadline - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        for i in stepping:
            done[i] += 1
            on_step(i, done[i], steps)
    return running


def image_latents(path: str, width: int, height: int) -> torch.Tensor:
    """The latents (1, 4, height/8, width/8) that ``decode`` turns into the picture at
    ``path`` resized to width x height: each 8x8 block's mean colour mapped back
    through the projection (its least-squares inverse, exact for colours it can
    make). A picture drawn in 8x8 blocks at that size comes back as it is."""
    from PIL import Image

    with Image.open(path) as opened:
        cells = opened.convert("RGB").resize((width // SCALE, height // SCALE), Image.Resampling.BOX)
    rgb = torch.from_numpy(np.asarray(cells, dtype=np.float32)) / 127.5 - 1.0  # (h, w, 3) in [-1, 1]
    z = rgb @ torch.linalg.pinv(_TO_RGB)  # (h, w, 4): z @ _TO_RGB == rgb
    return z.permute(2, 0, 1).unsqueeze(0).contiguous()


def decode(latents_: torch.Tensor) -> torch.Tensor:
    """Latents (batch, 4, h, w) to pixels (batch, 3, 8h, 8w) in [-1, 1], as a VAE's
    decode would return them."""
    rgb = torch.einsum("bchw,cr->brhw", latents_.float(), _TO_RGB)
    return torch.nn.functional.interpolate(rgb, scale_factor=SCALE, mode="nearest").clamp(-1, 1)
