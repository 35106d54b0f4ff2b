"""A job as a member of a batch in a denoising loop, the same for every model family:
what it runs with (``BatchMember``, ``MemberInputs``) and what it comes out with
(``MemberResult``: its latents, or ``JobSuspended``, ``BadOutput``, or the error of
its own inputs). The loop that runs members is a family's ``Denoiser``
(``gpu_worker.denoising.denoiser``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.denoising.prompts import Conditioning
from services.errors import DarkroomError, FieldViolation, InvalidArgument, JobInterrupted
from services.generation import GenerationParams

# What a member comes out with: its latents (num_images, C, H/8, W/8), or a video
# model's (num_videos, C, latent frames, H/8, W/8), on the CPU; or what ended it.
MemberResult = torch.Tensor | BaseException


class BadOutput(DarkroomError):
    """The sampler produced NaN, inf or a degenerate (near-constant) result."""


class JobSuspended(JobInterrupted):
    """A member stopped at a step boundary whose ``checkpoint`` resumes it there."""

    def __init__(self, job: str, checkpoint: Checkpoint) -> None:
        super().__init__(job)
        self.job = job
        self.checkpoint = checkpoint
        # The suspension's time is when the GPU stopped, which is before its
        # write lands (and perhaps before the GPU's next job starts).
        self.at = datetime.now(UTC)

    def __str__(self) -> str:
        return f"{self.job} suspended at step {self.checkpoint.step}/{self.checkpoint.total}"


def no_input_image(model: str) -> InvalidArgument:
    """What fails a member of an image-taking model given no input image (a job the
    gateway would refuse): the job's own fault, named by its field, never retried."""
    return InvalidArgument([FieldViolation("image", f"{model} takes an input image, and this job has none")])


def _never() -> bool:
    return False


@dataclass(frozen=True)
class MemberInputs:
    """What a job's input image is to its model, made before its batch runs
    (``gpu_worker.jobs.edit_inputs``): an edit's latents and mask, an upscale's pixels,
    and the pixels a text encoder that sees the image takes (Qwen-Image-Edit's); and
    the job's conditioning where its model's text encoders are the decoder service's
    (``text_encoders = "service"``): kept on the member, so that no eviction from the
    prompt cache can lose it before the loop reads it."""

    image_latents: torch.Tensor | None = None  # (1, C, H/8, W/8): an edit's input, encoded by its VAE
    mask: torch.Tensor | None = None  # (1, 1, H/8, W/8): inpainting, 1 where the model paints
    image: torch.Tensor | None = None  # (1, 3, h, w) in [-1, 1]: an upscale's input
    prompt_image: torch.Tensor | None = None  # (1, 3, h, w) uint8: the input as the text encoder sees it
    conditioning: Conditioning | None = None  # on the host, as the decoder service encoded it


@dataclass(frozen=True)
class BatchMember:
    params: GenerationParams
    on_step: Callable[[int, int], None]  # (step done, total), from the sampling thread
    stopping: threading.Event  # set from any thread: leave the batch at the next step
    resume: Checkpoint | None = None  # start from this checkpoint's step
    # Periodic checkpoints (the model's policy), from the sampling thread: the batch
    # waits for it, so it should hand the bytes off, not store them.
    on_checkpoint: Callable[[Checkpoint], None] | None = None
    # Asked, from the sampling thread, once ``stopping`` is seen: True leaves with
    # JobSuspended and a checkpoint, False with JobInterrupted.
    suspend: Callable[[], bool] = _never
    inputs: MemberInputs | None = None  # an edit's or upscale's input image, as its model takes it
    # After these steps its latents go to ``on_preview`` (step, total, latents on
    # the CPU), from the sampling thread: rough previews for its stream.
    preview_at: frozenset[int] = frozenset()
    on_preview: Callable[[int, int, torch.Tensor], None] | None = None
    # As it ends, from the sampling thread, where its model caches steps: how many
    # of its steps (resumed ones included) reused a prediction.
    on_cached_steps: Callable[[int], None] | None = None


def check_output(latents: torch.Tensor, min_std: float) -> None:
    """Raises BadOutput for latents no image should come from."""
    if not bool(torch.isfinite(latents).all()):
        raise BadOutput("the sampler produced NaN or infinite latents")
    for i, image in enumerate(latents):
        std = float(image.float().std())
        if std < min_std:
            raise BadOutput(f"image {i} is degenerate: latent standard deviation {std:.2e} < {min_std:.0e}")


def checked_output(latents: torch.Tensor, min_std: float) -> MemberResult:
    """A member's final latents read back to the host, or the BadOutput they are;
    checked on the host, which then costs the device nothing."""
    host = latents.to("cpu", torch.float32)
    try:
        check_output(host, min_std)
    except BadOutput as exc:
        return exc
    return host
