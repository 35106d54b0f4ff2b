"""A media request checked before anything is stored: a video's frames and fps, an
edit's input image, mask and strength, an upscale's input, each with the model's
defaults where the request says nothing and a violation naming the field; every
input's sides and aspect within its model's bounds, whatever size is asked, and a
Qwen-Image-Edit prompt within what its text encoder reads whole."""

from __future__ import annotations

import io
import struct
import zlib
from datetime import UTC, datetime

import pytest
from PIL import Image

from gateway.inputs import fit_within, read_input
from gateway.validation import check_submit, validate_submit
from services.errors import FieldViolation, InvalidArgument
from services.generation import Task
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

REGISTRY = ModelRegistry.load()
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), 128).save(out, format="PNG")
    return out.getvalue()


def check(**fields):
    return validate_submit(pb.SubmitJobRequest(prompt="x", **fields), REGISTRY, max_prompt_chars=100, now=NOW)


def violations(**fields) -> dict[str, str]:
    with pytest.raises(InvalidArgument) as refused:
        check(**fields)
    return {v.field: v.description for v in refused.value.violations}


def test_a_video_takes_its_models_frames_fps_and_guidance_and_mp4() -> None:
    job = check(model="tiny-wan")
    spec = REGISTRY.get("tiny-wan")
    p = job.params
    assert (p.frames, p.fps, p.guidance_scale) == (spec.default_frames, spec.default_fps, spec.default_guidance)
    assert job.output_format == "mp4" and job.task == Task.TEXT_TO_VIDEO
    assert check(model="tiny-wan", frames=13, fps=12, output_format=pb.OUTPUT_FORMAT_WEBP).output_format == "webp"


def test_frames_out_of_the_models_rule_are_named_with_the_nearest_that_fit() -> None:
    assert "1 plus a multiple of 4" in (said := violations(model="tiny-wan", frames=11)["frames"])
    assert "try 9 or 13" in said
    assert "5..33" in violations(model="tiny-wan", frames=37)["frames"]
    assert "5..33" in violations(model="tiny-wan", frames=1)["frames"], "one frame is an image"
    assert violations(model="tiny-wan", width=72)["width"] == "72 is not a multiple of 16 (tiny-wan)"


def test_an_edit_takes_its_inputs_size_fitted_to_the_model() -> None:
    job = check(model="tiny", image=png(100, 80))
    assert (job.params.width, job.params.height) == (96, 80) and job.params.strength == 0.8
    assert job.task == Task.IMAGE_TO_IMAGE and job.inputs is not None and job.inputs.mask is None
    big = check(model="tiny", image=png(2000, 1000))
    assert (big.params.width, big.params.height) == (512, 256)
    inpaint = check(model="tiny", image=png(64, 64), mask=png(64, 64, "L"))
    assert inpaint.task == Task.INPAINT and inpaint.params.strength == 1.0 and inpaint.params.mask_digest
    assert inpaint.params.image_digest != inpaint.params.mask_digest


def test_an_upscale_is_four_times_its_input() -> None:
    job = check(model="tiny-upscaler", image=png(32, 24))
    assert (job.params.width, job.params.height, job.task) == (128, 96, Task.UPSCALE)
    assert "multiple of 8" in violations(model="tiny-upscaler", image=png(30, 24))["image"]
    assert "is outside 64..512" in violations(model="tiny-upscaler", image=png(160, 24))["width"]


def test_every_media_mistake_is_named_at_once() -> None:
    said = violations(model="tiny-wan", frames=10, fps=0.5, image=png(8, 8), strength=2.0)
    assert set(said) == {"frames", "fps", "image", "strength"}


def test_an_image_claiming_more_pixels_than_allowed_is_refused_before_decoding() -> None:
    # A valid PNG header for 20000 x 20000 pixels, and nothing of its pixels.
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    found = read_input("image", data, max_bytes=2**20)
    assert isinstance(found, FieldViolation) and "pixels" in found.description
    too_big = read_input("image", png(16, 16), max_bytes=10)
    assert isinstance(too_big, FieldViolation) and "the limit is 10" in too_big.description


def test_fit_within_keeps_the_aspect_on_the_models_grid() -> None:
    tiny, wan = REGISTRY.get("tiny"), REGISTRY.get("tiny-wan")
    assert fit_within(1024, 768, tiny) == (512, 384)
    assert fit_within(100, 60, tiny) == (104, 64), "scaled up to the model's least size"
    assert fit_within(100, 60, wan) == (96, 48)


@pytest.mark.parametrize("model", ["tiny", "tiny-sd3", "tiny-flux-kontext", "tiny-qwen-image-edit", "tiny-upscaler"])
def test_an_input_past_its_models_bounds_is_refused_by_name_whatever_size_is_asked(model: str) -> None:
    """A size given in the request does not skip the check: Qwen-Image-Edit's text
    encoder sees the input at its own aspect, whatever the output's size."""
    asked = {} if model == "tiny-upscaler" else {"width": 128, "height": 128}
    assert violations(model=model, image=png(4096, 1), **asked) == {
        "image": f"is 4096x1 pixels; {model} takes an input of at least 16 px on each side"
    }
    said = violations(model=model, image=png(1024, 16), **asked)
    assert said.keys() == {"image"} and "an aspect ratio of 64:1" in said["image"]


def test_an_inpainting_mask_past_the_bounds_is_named_with_its_image() -> None:
    said = violations(model="tiny", image=png(4096, 8), mask=png(4096, 8, "L"), width=512, height=512)
    assert said.keys() == {"image", "mask"} and "at least 16 px" in said["mask"]


def test_qwen_image_edit_takes_inputs_within_four_to_one() -> None:
    assert "at most 4:1" in violations(model="tiny-qwen-image-edit", image=png(1040, 256))["image"]
    job = check(model="tiny-qwen-image-edit", image=png(1024, 256))
    assert (job.params.width, job.params.height) == (512, 128)
    assert check(model="tiny", image=png(1040, 256)).params.width == 512, "16:1 for the others"


def test_a_qwen_image_edit_prompt_past_what_its_encoder_reads_whole_is_refused_before_its_image_is_read() -> None:
    def checked(model: str, prompt: str, negative_prompt: str = "") -> None:
        req = pb.SubmitJobRequest(model=model, prompt=prompt, negative_prompt=negative_prompt, image=b"never read")
        check_submit(req, REGISTRY, max_prompt_chars=2000, now=NOW)

    with pytest.raises(InvalidArgument) as refused:
        checked("tiny-qwen-image-edit", prompt="x" * 1025, negative_prompt="é" * 513)
    assert [v.field for v in refused.value.violations] == ["prompt", "negative_prompt"]
    assert "is 1025 bytes in UTF-8; tiny-qwen-image-edit takes at most 1024" in str(refused.value)
    checked("tiny-qwen-image-edit", prompt="x" * 1024)
    checked("tiny-flux-kontext", prompt="x" * 2000)
