from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.validation import validate_submit
from services.errors import InvalidArgument
from services.models.registry import ModelRegistry
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

REGISTRY = ModelRegistry.load()
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_defaults_come_from_the_model() -> None:
    job = validate_submit(pb.SubmitJobRequest(model="tiny", prompt="x"), REGISTRY, max_prompt_chars=100, now=NOW)
    spec = REGISTRY.get("tiny")
    assert (job.params.width, job.params.height, job.params.steps) == (
        spec.default_width,
        spec.default_height,
        spec.default_steps,
    )
    assert job.params.num_images == 1 and job.params.guidance_scale == 7.5
    assert job.lane == "free" and job.idempotency_key is None
    assert 0 <= job.params.seed < 2**63


def test_explicit_values_are_kept() -> None:
    req = pb.SubmitJobRequest(
        model="tiny",
        prompt="x",
        width=64,
        height=128,
        steps=3,
        seed=0,
        guidance_scale=0.0,
        num_images=2,
        lane="paid",
        idempotency_key="k",
    )
    job = validate_submit(req, REGISTRY, max_prompt_chars=100, now=NOW)
    assert (job.params.width, job.params.height, job.params.steps, job.params.seed, job.params.guidance_scale) == (
        64,
        128,
        3,
        0,
        0.0,
    )
    assert job.params.num_images == 2 and job.priority > 0 and job.idempotency_key == "k"


def test_prompt_limit_is_the_configured_one() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_submit(pb.SubmitJobRequest(model="tiny", prompt="x" * 11), REGISTRY, max_prompt_chars=10, now=NOW)
    assert [v.field for v in err.value.violations] == ["prompt"]


def test_deadline_in_the_past_is_refused_and_a_future_one_kept() -> None:
    from datetime import timedelta

    req = pb.SubmitJobRequest(model="tiny", prompt="x")
    req.deadline.FromDatetime(NOW - timedelta(seconds=1))
    with pytest.raises(InvalidArgument) as err:
        validate_submit(req, REGISTRY, max_prompt_chars=100, now=NOW)
    assert [v.field for v in err.value.violations] == ["deadline"]
    req.deadline.FromDatetime(NOW + timedelta(minutes=5))
    assert validate_submit(req, REGISTRY, max_prompt_chars=100, now=NOW).deadline == NOW + timedelta(minutes=5)


@pytest.mark.parametrize("model", ["tiny-flux-kontext", "tiny-qwen-image-edit"])
def test_an_instruction_edit_without_an_input_image_is_refused_by_name(model: str) -> None:
    req = pb.SubmitJobRequest(model=model, prompt="make it night")
    with pytest.raises(InvalidArgument) as refused:
        validate_submit(req, REGISTRY, max_prompt_chars=100, now=NOW)
    assert [v.field for v in refused.value.violations] == ["image"]
