"""Previews of images while they denoise: when they are taken, what they are, and
that a job whose output policy withholds or blurs flagged outputs gets none."""

from __future__ import annotations

import io

import torch
from PIL import Image

from gateway.validation import under_output_policy
from gpu_worker.jobs.previews import job_preview_steps, preview_steps, previews
from services.models.spec import ModelFamily
from services.safety.verdicts import previews_allowed
from tests.records import new_job, record


def test_previews_are_evenly_spaced_and_never_the_last_step() -> None:
    assert preview_steps(30, 2) == {10, 20}
    assert preview_steps(30, 0) == frozenset()
    assert preview_steps(2, 3) == {1}, "steps too few for three: those there are"


def test_a_preview_is_a_jpeg_of_the_images_size_that_follows_the_latents() -> None:
    latents = torch.zeros(2, 4, 8, 8)
    latents[1, 0] = 2.0  # SD's first latent channel leans every colour up
    dark, bright = (Image.open(io.BytesIO(p)) for p in previews(latents, ModelFamily.TINY, 64, 48))
    assert (dark.format, dark.size) == ("JPEG", (64, 48))
    assert sum(bright.convert("L").getdata()) > sum(dark.convert("L").getdata())
    sdxl = previews(latents, ModelFamily.SDXL, 64, 48)
    assert sdxl[1] != previews(latents, ModelFamily.SD15, 64, 48)[1], "SDXL's latent space has its own colours"


def test_previews_go_out_only_where_outputs_leave_as_made() -> None:
    """A preview is never scored: a policy that withholds or blurs a flagged output
    gets none; "flag" (delivered as made) and "" (not checked) keep them."""
    assert [previews_allowed(p) for p in ("", "flag", "blur", "block")] == [True, True, False, False]


def test_the_gateway_stores_no_previews_for_a_job_whose_outputs_are_withheld_or_blurred() -> None:
    asked = new_job(previews=3)
    assert [(j.output_policy, j.previews) for j in (under_output_policy(asked, p) for p in ("block", "blur"))] == [
        ("block", 0),
        ("blur", 0),
    ]
    assert under_output_policy(asked, "flag").previews == 3
    assert under_output_policy(asked, "").previews == 3


def test_a_sampler_takes_no_previews_of_a_job_stored_asking_for_them_under_block_or_blur() -> None:
    """A job stored before the gateway dropped them (or by an older gateway) still
    says previews=3: the sampler reads its policy and takes none."""
    for policy, expected in (("block", frozenset()), ("blur", frozenset()), ("flag", {8, 15, 22}), ("", {8, 15, 22})):
        job = record(new_job(previews=3, output_policy=policy), steps=30)
        assert job_preview_steps(job) == expected, policy
