"""The output format a submit asks for: PNG unless it says otherwise, and a clear
InvalidArgument for a value the API does not know."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import cast

import pytest

from gateway.validation import validate_submit
from services.errors import InvalidArgument
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

REGISTRY = ModelRegistry.load()


def submit(output_format: pb.OutputFormat | None = None) -> str:
    req = pb.SubmitJobRequest(model="tiny", prompt="p", output_format=output_format)
    return validate_submit(req, REGISTRY, max_prompt_chars=100, now=datetime.now(UTC)).output_format


def test_each_format_is_stored_by_name_and_unset_means_png() -> None:
    assert submit() == "png"
    assert submit(output_format=pb.OUTPUT_FORMAT_PNG) == "png"
    assert submit(output_format=pb.OUTPUT_FORMAT_JPEG) == "jpeg"
    assert submit(output_format=pb.OUTPUT_FORMAT_WEBP) == "webp"


def test_an_unknown_format_is_named() -> None:
    with pytest.raises(InvalidArgument) as err:
        submit(cast(pb.OutputFormat, 9))
    [violation] = err.value.violations
    assert violation.field == "output_format"
    assert "9" in violation.description and "OUTPUT_FORMAT_WEBP" in violation.description
