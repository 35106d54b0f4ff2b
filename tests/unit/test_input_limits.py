"""What a model takes of a job's inputs (``services.models.input_limits``), pure: an
input image's shortest side and aspect ratio, by family and as the registry sets
them; a Qwen-Image-Edit prompt's bytes; and the condition size an image of any
shape is seen at, never a zero or absurd one: the pipeline's own within 4:1, its
tokens always within what a compiled network's text holds beside a whole prompt,
and a size the Qwen2-VL processor takes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from services.errors import ModelError
from services.models.input_limits import (
    EDIT_CONDITION_AREA,
    EDIT_CONDITION_TOKENS,
    edit_condition_size,
    image_violations,
    prompt_violations,
)
from services.models.qwen_tiny import QWEN_IMAGE_PROCESSOR
from services.models.registry import ModelRegistry

REGISTRY = ModelRegistry.load()
SIDES = st.integers(min_value=1, max_value=2**16)
# Qwen-Image-Edit's processor (Qwen2.5-VL-7B's): pixels per token and its bounds.
CELL = QWEN_IMAGE_PROCESSOR["patch_size"] * QWEN_IMAGE_PROCESSOR["merge_size"]
MIN_PIXELS = QWEN_IMAGE_PROCESSOR["size"]["shortest_edge"]
MAX_PIXELS = QWEN_IMAGE_PROCESSOR["size"]["longest_edge"]


def processor_tokens(width: int, height: int) -> int:
    """The image tokens the processor makes of a ``width`` x ``height`` picture
    (ValueError where it refuses it)."""
    h, w = smart_resize(height, width, CELL, MIN_PIXELS, MAX_PIXELS)
    return (h // CELL) * (w // CELL)


@pytest.mark.parametrize("size", [(4096, 1), (1, 4096), (65536, 1), (4096, 19)])
def test_an_extreme_input_gets_a_condition_size_the_processor_takes(size: tuple[int, int]) -> None:
    width, height = edit_condition_size(*size)
    assert width % 32 == 0 and height % 32 == 0
    assert min(width, height) >= 512 and max(width, height) / min(width, height) <= 4
    assert processor_tokens(width, height) <= EDIT_CONDITION_TOKENS


@given(SIDES, SIDES)
def test_every_input_gets_a_condition_size_of_about_a_megapixel_within_the_tokens(width: int, height: int) -> None:
    condition = edit_condition_size(width, height)
    assert all(side % 32 == 0 and 512 <= side <= 2048 for side in condition), condition
    assert 0.9 * EDIT_CONDITION_AREA <= condition[0] * condition[1] <= 1.1 * EDIT_CONDITION_AREA
    assert processor_tokens(*condition) <= EDIT_CONDITION_TOKENS


@st.composite
def shapes(draw: st.DrawFn, *, past: bool) -> tuple[int, int]:
    """A width and height within 4:1 (``past``: beyond it), either way round."""
    short = draw(st.integers(min_value=1, max_value=2**14 - 1))
    long = draw(st.integers(min_value=4 * short + 1, max_value=2**16) if past else st.integers(short, 4 * short))
    return (long, short) if draw(st.booleans()) else (short, long)


@given(shapes(past=False))
def test_within_four_to_one_the_condition_size_is_the_pipelines(size: tuple[int, int]) -> None:
    width, height = size
    assert edit_condition_size(width, height) == calculate_dimensions(EDIT_CONDITION_AREA, width / height)[:2]


@given(shapes(past=True))
def test_past_four_to_one_the_condition_image_is_squeezed_to_it(size: tuple[int, int]) -> None:
    squeezed = edit_condition_size(*size)
    assert squeezed == calculate_dimensions(EDIT_CONDITION_AREA, 4.0 if size[0] > size[1] else 0.25)[:2]


def described(field: str, width: int, height: int, model: str) -> list[tuple[str, str]]:
    return [(v.field, v.description) for v in image_violations(field, width, height, REGISTRY.get(model))]


@pytest.mark.parametrize("model", ["tiny", "tiny-sd3", "tiny-flux-kontext", "tiny-qwen-image-edit", "tiny-upscaler"])
def test_every_input_taking_family_refuses_a_side_under_16_and_an_extreme_aspect(model: str) -> None:
    assert described("image", 4096, 1, model) == [
        ("image", f"is 4096x1 pixels; {model} takes an input of at least 16 px on each side")
    ]
    assert described("mask", 15, 64, model)[0][0] == "mask"
    [(field, said)] = described("image", 2048, 64, model)
    assert field == "image" and said.startswith("is 2048x64 pixels, an aspect ratio of 32:1;")
    assert described("image", 64, 64, model) == [] and described("image", 16, 64, model) == []


def test_qwen_image_edit_takes_four_to_one_and_the_others_sixteen() -> None:
    assert described("image", 1024, 256, "tiny-qwen-image-edit") == []
    assert described("image", 1040, 256, "tiny-qwen-image-edit") == [
        ("image", "is 1040x256 pixels, an aspect ratio of 4.06:1; tiny-qwen-image-edit takes at most 4:1")
    ]
    assert described("image", 1024, 64, "tiny") == [] and described("image", 1040, 64, "tiny") != []


def test_the_registry_sets_a_models_own_limits() -> None:
    spec = replace(REGISTRY.get("tiny"), min_input_side=64, max_input_aspect=2.0, max_prompt_bytes=10)
    assert [v.field for v in image_violations("image", 32, 64, spec)] == ["image"]
    assert [v.field for v in image_violations("image", 200, 64, spec)] == ["image"]
    assert [v.field for v in prompt_violations("prompt", "x" * 11, spec)] == ["prompt"]


def test_a_qwen_image_edit_prompt_is_at_most_1024_bytes_in_utf8() -> None:
    spec = REGISTRY.get("tiny-qwen-image-edit")
    assert prompt_violations("prompt", "x" * 1024, spec) == []
    [violation] = prompt_violations("negative_prompt", "é" * 513, spec)  # 513 characters, 1,026 bytes
    assert violation.field == "negative_prompt" and violation.description.startswith(
        "is 1026 bytes in UTF-8; tiny-qwen-image-edit takes at most 1024"
    )
    assert prompt_violations("prompt", "x" * 5000, REGISTRY.get("tiny")) == [], "T5 and CLIP cut their own"


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("max_input_aspect = 0.5", "max_input_aspect must be a number >= 1"),
        ("max_input_aspect = nan", "max_input_aspect must be a number >= 1"),
        ("min_input_side = -1", "min_input_side must be a whole number >= 0"),
        ("max_prompt_bytes = 1.5", "max_prompt_bytes must be a whole number >= 0"),
    ],
)
def test_the_registry_refuses_limits_that_are_none(tmp_path: Path, line: str, says: str) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text(f'[models.tiny]\nsource = "builtin:tiny"\nfamily = "tiny"\n{line}\n')
    with pytest.raises(ModelError, match=says):
        ModelRegistry.load(registry)
