"""Moderation as plain data: the gateway's checks of a ModerateRequest (each mistake
named by its field), its verdicts for texts (the prompt filter) and images (a
classifier's score against the threshold, the classifier made once), and the
HTTP door's reading of OpenAI's request shapes and answer in OpenAI's shape."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np
import pytest
from PIL import Image

from gateway.moderation import MAX_INPUTS, Limits, Moderator, check_inputs
from http_api import moderations
from http_api.errors import HttpError
from services.errors import InvalidArgument
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.prompt_filter import PromptFilter

LIMITS = Limits(max_text_chars=20, max_image_bytes=10_000, threshold=0.5)


def png(size: tuple[int, int] = (32, 24), colour: tuple[int, int, int] = (200, 150, 120)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


class Redness:
    """A classifier that scores an image by its mean red: known scores, no model."""

    name = "redness"
    made = 0

    def __init__(self) -> None:
        Redness.made += 1

    def scores(self, images: Sequence[np.ndarray]) -> list[float]:
        return [float(image[..., 0].mean()) / 255 for image in images]


@pytest.fixture(scope="module")
def words() -> PromptFilter:
    return PromptFilter.shipped()


def fields(request: pb.ModerateRequest) -> list[str]:
    return [v.field for v in check_inputs(request, LIMITS)]


def test_inputs_are_checked_before_any_is_judged() -> None:
    assert fields(pb.ModerateRequest()) == ["inputs"]
    many = pb.ModerateRequest(inputs=[pb.ModerationInput(text="a")] * (MAX_INPUTS + 1))
    assert fields(many) == ["inputs"]
    mixed = pb.ModerateRequest(
        inputs=[
            pb.ModerationInput(text="fine"),
            pb.ModerationInput(),
            pb.ModerationInput(text="x" * 21),
            pb.ModerationInput(image=b""),
        ]
    )
    assert fields(mixed) == ["inputs[1]", "inputs[2].text", "inputs[3].image"]


async def test_texts_get_the_filter_s_categories_and_images_the_classifier_s_score(words: PromptFilter) -> None:
    Redness.made = 0
    moderator = Moderator(words, LIMITS, Redness)
    request = pb.ModerateRequest(
        inputs=[
            pb.ModerationInput(text="a lighthouse"),
            pb.ModerationInput(text="nsfw"),
            pb.ModerationInput(image=png(colour=(255, 0, 0))),
            pb.ModerationInput(image=png(colour=(51, 0, 0))),
        ]
    )
    clean, sexual, red, dark = (await moderator.moderate(request)).results
    assert not clean.flagged and dict(clean.categories) == {"profanity": False, "sexual": False}
    assert sexual.flagged and dict(sexual.category_scores) == {"profanity": 1.0, "sexual": 1.0}
    assert red.flagged and dict(red.categories) == {"sexual": True}
    assert red.category_scores["sexual"] == pytest.approx(1.0)
    assert not dark.flagged and dark.category_scores["sexual"] == pytest.approx(0.2)
    await moderator.moderate(pb.ModerateRequest(inputs=[pb.ModerationInput(image=png())]))
    assert Redness.made == 1  # made on the first image, once


async def test_an_image_that_does_not_decode_is_named(words: PromptFilter) -> None:
    moderator = Moderator(words, LIMITS, Redness)
    request = pb.ModerateRequest(
        inputs=[
            pb.ModerationInput(image=png()),
            pb.ModerationInput(image=b"not an image"),
            pb.ModerationInput(image=png((200, 200)) + b"\0" * 10_000),
        ]
    )
    with pytest.raises(InvalidArgument) as refused:
        await moderator.moderate(request)
    assert [v.field for v in refused.value.violations] == ["inputs[1].image", "inputs[2].image"]
    assert "10000" in refused.value.violations[1].description  # over the limit: said so


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_openai_s_three_shapes_of_input() -> None:
    one = moderations.moderation({"input": "a cat", "model": "omni-moderation-latest"})
    assert [i.text for i in one.request.inputs] == ["a cat"] and one.groups == ((0,),)
    many = moderations.moderation({"input": ["a", "b"]})
    assert many.groups == ((0,), (1,))
    image = png()
    parts = moderations.moderation(
        {"input": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}
    )
    assert parts.request.inputs[1].image == image
    assert parts.groups == ((0, 1),)  # one result for the parts together, as OpenAI answers


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": "a", "stream": True}, "stream"),
        ({"input": ["a", {"type": "text", "text": "b"}]}, "input[0]"),
        ({"input": [{"type": "audio"}]}, "input[0].type"),
        ({"input": [{"type": "text", "text": 1}]}, "input[0].text"),
        ({"input": [{"type": "image_url", "image_url": "data:,"}]}, "input[0].image_url"),
        ({"input": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}, "input[0].image_url"),
        ({"input": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}, "input[0].image_url"),
        ({"input": [{"type": "image_url", "image_url": {"url": "data:image/png,raw"}}]}, "input[0].image_url"),
    ],
)
def test_a_bad_request_is_a_400_naming_its_parameter(body: dict, param: str) -> None:
    with pytest.raises(HttpError) as refused:
        moderations.moderation(body)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_remote_image_is_refused_saying_why() -> None:
    with pytest.raises(HttpError, match="not fetched"):
        moderations.image_bytes("http://example.com/a.png", "input[0].image_url")


def test_the_gateway_s_fields_are_named_as_the_caller_named_them() -> None:
    one = moderations.moderation({"input": "a"})
    many = moderations.moderation({"input": ["a", "b"]})
    parts = moderations.moderation({"input": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert moderations.param_of("inputs[0].text", one) == "input"
    assert moderations.param_of("inputs[1].text", many) == "input[1]"
    assert moderations.param_of("inputs[1].text", parts) == "input[1].text"
    assert moderations.param_of("inputs[1].image", parts) == "input[1].image_url"
    assert moderations.param_of("inputs", parts) == "input"


def test_parts_answer_one_result_combining_theirs() -> None:
    asked = moderations.moderation(
        {"input": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": data_url(png())}}]}
    )
    text = pb.ModerationResult(
        flagged=False, categories={"profanity": False, "sexual": False}, category_scores={"profanity": 0, "sexual": 0}
    )
    image = pb.ModerationResult(flagged=True, categories={"sexual": True}, category_scores={"sexual": 0.3})
    body = moderations.response([text, image], asked)
    assert body["id"].startswith("modr-") and body["model"] == moderations.MODEL
    [result] = body["results"]
    assert result["flagged"] is True
    assert result["categories"] == {"profanity": False, "sexual": True}
    assert result["category_scores"] == {"profanity": 0.0, "sexual": 0.3}  # float32's 0.30000001 rounded
    assert result["category_applied_input_types"] == {"profanity": ["text"], "sexual": ["image", "text"]}
