"""What a job asks a model to make, typed once: the gateway builds it from the
request, the database stores it, the scheduler places it by its shape, and the
sampler runs it. Jobs of one ``BatchKey`` may start as one batch; a job may join a
running batch of its ``JoinKey`` at a step boundary (continuous batching)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Task(enum.StrEnum):
    """What a job makes, from what: decided by its model and its inputs."""

    TEXT_TO_IMAGE = "text_to_image"
    IMAGE_TO_IMAGE = "image_to_image"
    INPAINT = "inpaint"
    TEXT_TO_VIDEO = "text_to_video"
    UPSCALE = "upscale"


@dataclass(frozen=True, order=True)
class BatchKey:
    """Jobs of one key may run as one batch: one model, one size (frames too), one
    number of steps and one guidance scale."""

    model: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    frames: int = 1

    @property
    def join_key(self) -> JoinKey:
        return JoinKey(self.model, self.width, self.height, self.frames)


@dataclass(frozen=True, order=True)
class JoinKey:
    """Jobs of one join key can share one call of their model's network whatever
    their steps, guidance and seeds: one model, one latent size. A job joins a
    running batch of its join key at the batch's next step boundary."""

    model: str
    width: int
    height: int
    frames: int = 1


@dataclass(frozen=True)
class JobShape:
    """What a worker batches a job by and what it costs: its key and its outputs."""

    model: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    num_images: int
    frames: int = 1

    @property
    def key(self) -> BatchKey:
        return BatchKey(self.model, self.width, self.height, self.steps, self.guidance_scale, self.frames)

    @property
    def join_key(self) -> JoinKey:
        return self.key.join_key

    @property
    def pixels(self) -> int:
        """Pixels of one output: an image's, or all of a video's frames."""
        return self.width * self.height * self.frames


@dataclass(frozen=True)
class Prompts:
    """A job's prompt and negative prompt as its sampler encodes them: an expanded
    prompt in its prompt's place."""

    prompt: str
    negative_prompt: str


@dataclass(frozen=True)
class AdapterUse:
    """A LoRA adapter a job applies: a version of the model store's, and its scale.
    ``owner``: the tenant whose own adapter it is (in the store under its
    tenant's prefix), "" for the operator's (the store's own)."""

    name: str
    version: str
    scale: float = 1.0
    owner: str = ""

    @property
    def key(self) -> str:
        """What names the adapter's bytes: one version is one content (of its owner's)."""
        return f"{self.owner}/{self.name}:{self.version}" if self.owner else f"{self.name}:{self.version}"


@dataclass(frozen=True)
class GenerationParams:
    """Everything that decides a job's outputs: the same parameters (and input
    images) give the same outputs (exactly on a CPU, within floating-point error on
    a GPU)."""

    model: str
    prompt: str
    negative_prompt: str
    width: int  # of each output (an upscale's: four times its input's)
    height: int
    steps: int
    guidance_scale: float
    seed: int  # of the first output; output i has seed + i
    num_images: int  # outputs: images, or videos of a video model
    frames: int = 1  # of each output: 1 for an image
    fps: float = 0.0  # a video's frames per second; 0 for an image
    # An edit's share of the denoising: 1.0 repaints everything (and is what a job
    # without an input image has); 0.3 keeps most of the input image.
    strength: float = 1.0
    # SHA-256 (hex) of the input image and the inpainting mask, stored beside the
    # job (``job_inputs``); empty: none.
    image_digest: str = ""
    mask_digest: str = ""
    # LoRA adapters, in the order the request named them (members of one batch may
    # each have their own).
    adapters: tuple[AdapterUse, ...] = ()

    @property
    def shape(self) -> JobShape:
        return JobShape(
            self.model, self.width, self.height, self.steps, self.guidance_scale, self.num_images, self.frames
        )

    @property
    def key(self) -> BatchKey:
        return self.shape.key

    @property
    def join_key(self) -> JoinKey:
        return self.shape.join_key

    @property
    def is_video(self) -> bool:
        return self.frames > 1

    def task(self, upscales: bool) -> Task:
        """What the job makes, given whether its model upscales."""
        if upscales:
            return Task.UPSCALE
        if self.is_video:
            return Task.TEXT_TO_VIDEO
        if self.mask_digest:
            return Task.INPAINT
        return Task.IMAGE_TO_IMAGE if self.image_digest else Task.TEXT_TO_IMAGE

    def first_step(self) -> int:
        """The step an edit's denoising starts at: the last ``strength`` of the
        steps run, as diffusers' image-to-image pipelines do (at least one)."""
        if not self.image_digest or self.strength >= 1.0:
            return 0
        return self.steps - max(1, min(self.steps, int(self.steps * self.strength)))


@dataclass(frozen=True)
class JobInputs:
    """A job's input image (PNG, JPEG or WebP bytes) and its inpainting mask, as
    submitted; stored apart from the job, read by the sampler that runs it."""

    image: bytes
    mask: bytes | None = None
