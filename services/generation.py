"""What a job asks a model to make, typed once: the gateway builds it from the
request, the database stores it, the scheduler places it by its shape, and the
sampler runs it. Jobs of one ``BatchKey`` may run as one batch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class BatchKey:
    """Jobs of one key may run as one batch: one model, one size, one number of
    steps and one guidance scale."""

    model: str
    width: int
    height: int
    steps: int
    guidance_scale: float


@dataclass(frozen=True)
class JobShape:
    """What a worker batches a job by and what it costs: its key and its images."""

    model: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    num_images: int

    @property
    def key(self) -> BatchKey:
        return BatchKey(self.model, self.width, self.height, self.steps, self.guidance_scale)


@dataclass(frozen=True)
class GenerationParams:
    """Everything that decides a job's images: the same parameters give the same
    images (exactly on a CPU, within floating-point error on a GPU)."""

    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int  # of the first image; image i has seed + i
    num_images: int

    @property
    def shape(self) -> JobShape:
        return JobShape(self.model, self.width, self.height, self.steps, self.guidance_scale, self.num_images)

    @property
    def key(self) -> BatchKey:
        return BatchKey(self.model, self.width, self.height, self.steps, self.guidance_scale)
