"""A job's own bad input, found by the sampler that prepares it (a job stored before
the gateway bounded inputs, or by an older gateway), is the job's fault: it fails
alone, never retried, naming the field, and counts nothing against its worker; its
batch-mates run. Over in-memory fakes of the job store and the decoders, the real
input preparation (``gpu_worker.jobs.edit_inputs``) and the runner of test_runner."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
from PIL import Image

from gpu_worker.decoding.decoders import Decoders
from gpu_worker.denoising.members import MemberInputs
from gpu_worker.jobs.edit_inputs import EditInputs
from gpu_worker.jobs.failures import classify
from gpu_worker.jobs.job_store import JobStore
from gpu_worker.jobs.outcomes import Outcome
from services.db.records import JobRecord
from services.db.states import JobStatus
from services.errors import InvalidArgument
from services.generation import JobInputs, Task
from services.models.registry import ModelRegistry
from tests.records import new_job, record
from tests.unit.test_runner import Harness

REGISTRY = ModelRegistry.load()
EDIT = "tiny-qwen-image-edit"


def png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class StoredInputs:
    """The job store's side of the inputs: what was stored for each job."""

    def __init__(self, stored: dict[str, JobInputs]) -> None:
        self.stored = stored

    async def inputs(self, jobs: Sequence[JobRecord]) -> dict[str, JobInputs]:
        return {job.id: self.stored[job.id] for job in jobs if job.id in self.stored}


class EncodingDecoders:
    """A decoder service that encodes any image it is sent: zeros of its latents' shape."""

    locally = False

    def __init__(self) -> None:
        self.encoded: list[str] = []

    async def encode(self, job: JobRecord, image: bytes, width: int, height: int) -> torch.Tensor:
        self.encoded.append(job.id)
        return torch.zeros(1, 16, height // 8, width // 8)


def edit(job_id: str, model: str = EDIT, task: Task = Task.IMAGE_TO_IMAGE) -> JobRecord:
    new = new_job(id=job_id, model=model, width=64, height=64, image_digest=f"digest-{job_id}", task=task)
    return record(new, status=JobStatus.SCHEDULED, attempt=1, worker_id="w1")


def preparation(stored: dict[str, JobInputs]) -> tuple[EditInputs, EncodingDecoders]:
    decoders = EncodingDecoders()
    return EditInputs(cast(JobStore, StoredInputs(stored)), cast(Decoders, decoders), REGISTRY), decoders


async def test_each_bad_input_fails_its_own_job_as_its_fault_before_any_decoder_sees_it() -> None:
    jobs = [
        edit("thin"),  # 4096x1: a condition size of 65536x0 before its bounds
        edit("wide", model="tiny"),  # 40:1 for an image-to-image edit
        edit("mask", model="tiny"),
        edit("upscale", model="tiny-upscaler", task=Task.UPSCALE),
        edit("unstored"),
        edit("fine"),
    ]
    inputs, decoders = preparation(
        {
            "thin": JobInputs(png(4096, 1)),
            "wide": JobInputs(png(1280, 32)),
            "mask": JobInputs(png(64, 64), b"no image at all"),
            "upscale": JobInputs(png(8, 64)),
            "fine": JobInputs(png(64, 96)),
        }
    )
    prepared = await inputs.prepare(jobs)
    assert isinstance(prepared["fine"], MemberInputs) and prepared["fine"].prompt_image is not None
    bad = {job_id: found for job_id, found in prepared.items() if job_id != "fine"}
    assert all(isinstance(found, InvalidArgument) for found in bad.values()), bad
    fields = {job_id: [v.field for v in cast(InvalidArgument, found).violations] for job_id, found in bad.items()}
    assert fields == {
        "thin": ["image"],
        "wide": ["image"],
        "mask": ["mask"],
        "upscale": ["image"],
        "unstored": ["image"],
    }
    for found in bad.values():
        failure = classify(cast(Exception, found))
        assert (failure.retryable, failure.blames_worker, failure.cause) == (False, False, "invalid input")
    assert decoders.encoded == ["fine"], "nothing of a bad input reaches a decoder"


async def test_a_bad_input_in_a_batch_fails_alone_and_leaves_its_worker_fit() -> None:
    """One failure the worker's would make it unfit (``unfit_after=1``)."""
    h = Harness(unfit_after=1)
    for job in (edit("bad"), edit("good")):
        h.repo.attempts.jobs[job.id] = job
    h.runner.edit_inputs, _ = preparation({"bad": JobInputs(png(4096, 1)), "good": JobInputs(png(64, 96))})
    assert await h.run("bad", "good") == [Outcome.STORED, Outcome.STORED]
    [(job_id, error, retryable)] = h.repo.attempts.failed
    assert (job_id, retryable) == ("bad", False) and error.startswith("image: is 4096x1 pixels")
    assert h.events.statuses("good")[-1] == JobStatus.SUCCEEDED
    assert h.runner.failures.count == 0 and not h.runner.unfit
