"""The image filter's policy, as plain data: which policy a job gets at submit, what
a score comes to under it, what is encoded of an output once judged; and the
filter itself over a stand-in classifier (a video scored by its sampled frames,
one classifier call per batch, fail-closed without a classifier)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from http_api import images
from http_api.errors import withheld
from services.config.fields import SettingsError
from services.config.safety import SafetySettings
from services.models import sim
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety import image_filter as image_filter_module
from services.safety.image_filter import (
    ImageFilter,
    ImageFilterUnavailable,
    check_outputs,
    image_filter_of,
    load_image_filter,
)
from services.safety.metrics import OUTPUTS_FLAGGED
from services.safety.verdicts import (
    BLOCKED,
    BLURRED,
    FLAGGED,
    PASSED,
    blurred,
    judged,
    output_policy,
    sampled_frames,
    verdict,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "flagged.png"
SAFETY = SafetySettings(output_policies=(("free", "block"), ("paid", "blur")))


def test_a_jobs_policy_is_its_tenants_else_its_lanes_and_none_while_the_filter_is_off() -> None:
    assert output_policy(SAFETY, "free", None) == "block"
    assert output_policy(SAFETY, "paid", None) == "blur"
    assert output_policy(SAFETY, "batch", None) == "flag"  # a lane not named
    assert output_policy(SAFETY, "free", "flag") == "flag"  # the tenant's own
    off = SafetySettings(image_filter=False)
    assert output_policy(off, "free", "block") == ""


@pytest.mark.parametrize(
    ("policy", "score", "expected"),
    [
        ("flag", 0.8, FLAGGED),  # the threshold itself flags
        ("blur", 0.95, BLURRED),
        ("block", 0.99, BLOCKED),
        ("block", 0.79, PASSED),
        ("block", None, PASSED),  # not checked
        ("", 0.99, PASSED),  # a job not checked
    ],
)
def test_a_score_comes_to_its_policys_verdict_from_the_threshold(
    policy: str, score: float | None, expected: str
) -> None:
    assert verdict(policy, score, 0.8) == expected


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of"):
        verdict("hide", 0.9, 0.8)


def test_a_video_is_scored_by_at_most_eight_evenly_spaced_frames_from_first_to_last() -> None:
    assert sampled_frames(5) == [0, 1, 2, 3, 4]
    assert sampled_frames(81) == [0, 11, 23, 34, 46, 57, 69, 80]
    assert sampled_frames(1) == [0]


def picture(seed: int = 0, size: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def test_blocked_is_nothing_blurred_is_smooth_flagged_and_passed_are_as_made() -> None:
    pixels = picture()
    assert judged(pixels, "block", 0.9, 0.8).pixels is None
    assert judged(pixels, "flag", 0.9, 0.8).pixels is pixels
    assert judged(pixels, "block", 0.1, 0.8).pixels is pixels
    soft = judged(pixels, "blur", 0.9, 0.8)
    assert soft.verdict == BLURRED and soft.nsfw_score == 0.9
    assert soft.pixels is not None and soft.pixels.shape == pixels.shape and soft.pixels.dtype == np.uint8
    # Noise under a blur of radius 4 (64/16): neighbouring pixels all but agree.
    assert (
        np.abs(np.diff(soft.pixels.astype(int), axis=1)).mean()
        < np.abs(np.diff(pixels.astype(int), axis=1)).mean() / 10
    )


def test_a_video_is_blurred_frame_by_frame() -> None:
    video = np.stack([picture(0, 32), picture(1, 32)])
    soft = blurred(video)
    assert soft.shape == video.shape
    assert np.array_equal(soft[1], blurred(video[1]))


class Scripted:
    """A classifier whose score of an image is its top-left pixel's red, over 255."""

    name = "scripted"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def scores(self, images: Sequence[np.ndarray]) -> list[float]:
        self.calls.append(len(images))
        return [float(image[0, 0, 0]) / 255 for image in images]


def scored(red: int, size: int = 16) -> np.ndarray:
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    pixels[0, 0, 0] = red
    return pixels


def test_a_batch_is_scored_in_one_call_and_a_video_by_its_highest_sampled_frame() -> None:
    classifier = Scripted()
    image_filter = ImageFilter(classifier, 0.8)
    video = np.stack([scored(0)] * 20 + [scored(255)])  # only its last frame would be flagged
    assert image_filter.scores([scored(51), video]) == [pytest.approx(0.2), 1.0]
    assert classifier.calls == [1 + 8]


def test_each_output_is_judged_by_its_own_jobs_policy_and_flags_are_counted() -> None:
    classifier = Scripted()
    image_filter = ImageFilter(classifier, 0.8)

    def count(v: str) -> float:
        return OUTPUTS_FLAGGED.labels(category="sexual", verdict=v)._value.get()

    before = {v: count(v) for v in (FLAGGED, BLURRED, BLOCKED)}
    outputs = [scored(250), scored(250), scored(250), scored(10), scored(250)]
    found = image_filter.check(outputs, ["flag", "blur", "block", "block", ""])
    assert [j.verdict for j in found] == [FLAGGED, BLURRED, BLOCKED, PASSED, PASSED]
    assert [j.nsfw_score for j in found][3:] == [pytest.approx(10 / 255), None]  # the last is not checked
    assert classifier.calls == [4]  # the checked ones, together
    assert {v: count(v) - before[v] for v in before} == {FLAGGED: 1, BLURRED: 1, BLOCKED: 1}


def test_without_a_classifier_an_output_to_be_checked_fails_and_others_pass_unchecked() -> None:
    with pytest.raises(ImageFilterUnavailable, match="not returned unchecked"):
        check_outputs(None, [scored(0)], ["flag"])
    [unchecked] = check_outputs(None, [scored(0)], [""])
    assert unchecked.nsfw_score is None and unchecked.verdict == PASSED


async def test_a_filter_that_cannot_load_keeps_its_process_from_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(threads: int = 1) -> None:
        raise OSError("no model file")

    monkeypatch.setattr(image_filter_module, "OpenNsfw", broken)
    with pytest.raises(SettingsError, match=r"cannot load .*no model file.*DARKROOM_IMAGE_FILTER=false"):
        await image_filter_of(SafetySettings())
    assert await image_filter_of(SafetySettings(image_filter=False)) is None


def test_the_http_door_leaves_blocked_outputs_out_and_refuses_a_request_with_none_left() -> None:
    job = pb.Job(job_id="j", width=64, height=64, output_format=pb.OUTPUT_FORMAT_PNG)
    outputs = [
        pb.Image(data=b"a", verdict="flagged", nsfw_score=0.9),
        pb.Image(data=b"", verdict="blocked", nsfw_score=0.95),
        pb.Image(data=b"c", nsfw_score=0.01),
    ]
    body = images.images_response(job, outputs, images.Asked(response_format="url"), lambda i: f"/files/j/{i}")
    assert body["data"] == [{"url": "/files/j/0"}, {"url": "/files/j/2"}]  # each link names its own output
    assert images.returned([outputs[1]]) == []
    refusal = withheld("j")
    assert (refusal.status, refusal.code, refusal.should_retry) == (400, "content_policy_violation", False)
    assert refusal.body()["job_id"] == "j"


def test_the_fixture_is_flagged_and_a_sim_model_decodes_its_latents_back_to_it_exactly() -> None:
    with Image.open(FIXTURE) as opened:
        fixture = np.asarray(opened.convert("RGB"))
    z = sim.image_latents(str(FIXTURE), 128, 128)
    assert z.shape == (1, 4, 16, 16)
    decoded = ((sim.decode(z) / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)  # as the decoder makes pixels
    assert np.array_equal(decoded[0].permute(1, 2, 0).numpy(), fixture)
    image_filter = load_image_filter(SafetySettings())
    assert image_filter is not None
    [score] = image_filter.scores([fixture])
    assert score >= 0.9
