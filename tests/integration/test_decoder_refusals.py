"""A decoder's refusal of a job's own input is the job's fault, with real decoder
services (as in test_decoder_choice): an edit's image whose header reads but whose
pixels do not (what the sampler's header check lets through), or a Qwen-Image-Edit
prompt asked without the image its text encoder sees, fails the job at once as
InvalidArgument naming the field, never retried and blaming no sampler, rather
than being tried on every decoder until the patience is spent and retried on
another sampler as "decoders away". A refusal of the model (another decoder's
registry may serve it) still goes on to the next decoder."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpu_worker.decoding.decoders import Decoders
from gpu_worker.decoding.prompt_encoders import PromptEncodeUnavailable, served_conditioning
from gpu_worker.jobs.failures import classify
from services.db.records import JobRecord
from services.db.states import JobStatus
from services.errors import InvalidArgument
from tests.integration.test_decoder_choice import (
    STALE_AFTER_S,
    Backends,
    backends,
    data_dir,
    database_url,
    decoder_service,
    presence,
)
from tests.records import new_job, record

__all__ = ["backends", "data_dir", "database_url", "presence"]  # the fixtures, shared with test_decoder_choice

pytestmark = pytest.mark.integration

EDIT = "tiny-qwen-image-edit"


def truncated_png() -> bytes:
    """A PNG whose header Pillow reads (its size) and whose pixels it cannot."""
    pixels = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    whole = out.getvalue()
    with Image.open(io.BytesIO(whole[: len(whole) // 2])) as opened:
        assert opened.size == (64, 64)
    return whole[: len(whole) // 2]


def edit(job_id: str, model: str) -> JobRecord:
    new = new_job(id=job_id, model=model, width=64, height=64, image_digest=f"digest-{job_id}")
    return record(new, status=JobStatus.RUNNING, attempt=1, worker_id="sampler")


def assert_the_jobs_own(exc: InvalidArgument) -> None:
    assert [v.field for v in exc.violations] == ["image"]
    failure = classify(exc)
    assert (failure.cause, failure.retryable, failure.blames_worker) == ("invalid input", False, False)


async def test_an_image_a_decoder_cannot_read_fails_its_job_as_its_own(backends: Backends) -> None:
    async with decoder_service(backends, "decoder-a"), decoder_service(backends, "decoder-b"):
        decoders = Decoders(backends.presence, stale_after_s=STALE_AFTER_S, patience_s=2.0)
        try:
            with pytest.raises(InvalidArgument) as err:
                await decoders.encode(edit("truncated", "tiny"), truncated_png(), 64, 64)
        finally:
            await decoders.close()
    assert "cannot be read" in str(err.value)
    assert_the_jobs_own(err.value)


async def test_a_served_prompt_refused_for_its_missing_image_fails_its_job_and_a_refused_model_is_retried(
    backends: Backends, tmp_path: Path
) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text(
        f'[models.{EDIT}]\nsource = "builtin:{EDIT}"\nfamily = "qwen_image_edit"\ndtype = "float32"\n'
        'size_step = 16\ntext_encoders = "service"\n'
    )
    async with decoder_service(backends, "decoder-a", model_registry=str(registry)):
        decoders = Decoders(backends.presence, stale_after_s=STALE_AFTER_S, patience_s=2.0)
        try:
            with pytest.raises(InvalidArgument) as err:
                await served_conditioning(decoders, edit("imageless", EDIT), guided=True)
            with pytest.raises(PromptEncodeUnavailable) as unserved:
                await served_conditioning(decoders, edit("unserved", "tiny"), guided=True)
        finally:
            await decoders.close()
    assert "text encoder sees the input image" in str(err.value)
    assert_the_jobs_own(err.value)
    assert "INVALID_ARGUMENT" in str(unserved.value) and "model" in str(unserved.value)
    failure = classify(unserved.value)
    assert failure.retryable and not failure.blames_worker
