"""Moderation as plain data: the gateway's checks of a ModerateRequest (each mistake
named by its field), its verdicts for texts (the prompt filter) and images (a
classifier's score against the threshold, the classifier made once, each image
brought down to its input and scored alone), and the HTTP door's reading of
OpenAI's request shapes (counted and measured before any input is converted) and
answer in OpenAI's whole shape."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence

import numpy as np
import pytest
from openai.types.moderation import Moderation
from PIL import Image

from gateway.moderation import CLASSIFIER_SIZE, Limits, Moderator, check_inputs
from http_api import moderations
from http_api.errors import HttpError
from http_api.limits import moderation_bytes
from services.errors import InvalidArgument
from services.moderation import MAX_INPUTS
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.prompt_filter import PromptFilter

LIMITS = Limits(max_text_chars=20, max_image_bytes=10_000, threshold=0.5)
DOOR = moderations.Limits(max_text_chars=20, max_image_bytes=10_000)


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
    one = moderations.moderation({"input": "a cat", "model": "omni-moderation-latest"}, DOOR)
    assert [i.text for i in one.request.inputs] == ["a cat"] and one.groups == ((0,),)
    many = moderations.moderation({"input": ["a", "b"]}, DOOR)
    assert many.groups == ((0,), (1,))
    image = png()
    parts = moderations.moderation(
        {"input": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}, DOOR
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
        moderations.moderation(body, DOOR)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_remote_image_is_refused_saying_why() -> None:
    remote = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    with pytest.raises(HttpError, match="not fetched"):
        moderations.moderation({"input": [remote]}, DOOR)


def test_the_gateway_s_fields_are_named_as_the_caller_named_them() -> None:
    one = moderations.moderation({"input": "a"}, DOOR)
    many = moderations.moderation({"input": ["a", "b"]}, DOOR)
    parts = moderations.moderation({"input": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, DOOR)
    assert moderations.param_of("inputs[0].text", one) == "input"
    assert moderations.param_of("inputs[1].text", many) == "input[1]"
    assert moderations.param_of("inputs[1].text", parts) == "input[1].text"
    assert moderations.param_of("inputs[1].image", parts) == "input[1].image_url"
    assert moderations.param_of("inputs", parts) == "input"


def test_parts_answer_one_result_combining_theirs() -> None:
    asked = moderations.moderation(
        {"input": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": data_url(png())}}]}, DOOR
    )
    text = pb.ModerationResult(
        flagged=False, categories={"profanity": False, "sexual": False}, category_scores={"profanity": 0, "sexual": 0}
    )
    image = pb.ModerationResult(flagged=True, categories={"sexual": True}, category_scores={"sexual": 0.3})
    body = moderations.response([text, image], asked)
    assert body["id"].startswith("modr-") and body["model"] == moderations.MODEL
    [result] = body["results"]
    assert result["flagged"] is True
    assert (result["categories"]["profanity"], result["categories"]["sexual"]) == (False, True)
    scores = result["category_scores"]
    assert (scores["profanity"], scores["sexual"]) == (0.0, 0.3)  # float32's 0.30000001 rounded
    applied = result["category_applied_input_types"]
    assert (applied["profanity"], applied["sexual"]) == (["text"], ["image", "text"])


def test_every_answer_holds_every_category_openai_requires_and_says_which_were_checked() -> None:
    """OpenAI's schema requires all thirteen categories in ``categories``,
    ``category_scores`` and ``category_applied_input_types``: a client generated from
    it rejects an answer without them. Those Darkroom does not check are false, 0,
    and applied to no input (``[]``, as OpenAI says "not applied")."""
    text = pb.ModerationResult(
        flagged=True, categories={"profanity": True, "sexual": True}, category_scores={"profanity": 1, "sexual": 1}
    )
    image = pb.ModerationResult(flagged=False, categories={"sexual": False}, category_scores={"sexual": 0.25})
    part_of = {
        "text": {"type": "text", "text": "a"},
        "image": {"type": "image_url", "image_url": {"url": data_url(png())}},
    }
    answers = [
        moderations.response([text], moderations.moderation({"input": "a"}, DOOR)),
        moderations.response([text, text], moderations.moderation({"input": ["a", "b"]}, DOOR)),
        moderations.response([image], moderations.moderation({"input": [part_of["image"]]}, DOOR)),
        moderations.response([text, image], moderations.moderation({"input": list(part_of.values())}, DOOR)),
    ]
    for body in answers:
        for result in body["results"]:
            checked = Moderation.model_validate(result, strict=True)  # the SDK's type of OpenAI's schema
            for name in moderations.OPENAI_CATEGORIES:
                assert name in result["categories"] and name in result["category_scores"], name
                if name != "sexual":
                    assert result["categories"][name] is False and result["category_scores"][name] == 0.0
                    assert result["category_applied_input_types"][name] == [], name
            assert checked.categories.violence is False
    image_only = answers[2]["results"][0]["category_applied_input_types"]
    assert image_only["sexual"] == ["image"] and "profanity" not in image_only  # no text: no text's category
    assert answers[0]["results"][0]["category_applied_input_types"]["sexual"] == ["text"]


def forbidden(*args: object, **kwargs: object) -> None:
    raise AssertionError("reached: an input was converted before every input was counted and measured")


@pytest.mark.parametrize(
    ("given", "param", "says"),
    [
        (["a"] * (MAX_INPUTS + 1), "input", f"{MAX_INPUTS + 1} inputs; at most {MAX_INPUTS}"),
        ([{"type": "text", "text": "a"}] * (MAX_INPUTS + 1), "input", f"{MAX_INPUTS + 1} inputs"),
        ("x" * 21, "input", "21 characters; the limit is 20"),
        (["a", "x" * 21], "input[1]", "21 characters"),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "x" * 21}], "input[1].text", "21 characters"),
        ([{"type": "image_url", "image_url": {"url": data_url(b"\0" * 10_001)}}], "input[0].image_url", "10001 bytes"),
    ],
)
def test_the_door_counts_and_measures_the_inputs_before_it_converts_any(
    given: object, param: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pb, "ModerationInput", forbidden)
    monkeypatch.setattr(moderations.base64, "b64decode", forbidden)
    with pytest.raises(HttpError) as refused:
        moderations.moderation({"input": given}, DOOR)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert says in refused.value.message, refused.value.message


def test_the_route_s_limit_fits_32_inputs_at_their_largest() -> None:
    """A moderation's body may hold 32 texts at the gateway's longest, each
    character escaped at its longest (past U+FFFF, twelve bytes), or images of
    ``DARKROOM_MAX_INPUT_MB`` in base64 (two at most, as an edit's body)."""
    max_mb, max_chars = 0.5, 300
    limit = moderation_bytes(max_mb, max_chars)
    texts = {"input": [{"type": "text", "text": "\U0001f600" * max_chars}] * MAX_INPUTS, "model": "omni-moderation"}
    image = {"type": "image_url", "image_url": {"url": data_url(b"\xff" * int(max_mb * 2**20))}}
    images = {"input": [image, image], "model": "omni-moderation-latest"}
    for body in (texts, images):
        assert len(json.dumps(body, indent=2).encode()) <= limit
    # And no more than that: what a text-only body needs, and two images, with room for the JSON around them.
    assert limit < len(json.dumps(texts).encode()) + len(json.dumps(images).encode()) + MAX_INPUTS * 512


class Seen:
    """A classifier that records what each call was given."""

    name = "seen"
    calls: list[list[tuple[int, ...]]] = []

    def scores(self, images: Sequence[np.ndarray]) -> list[float]:
        Seen.calls.append([image.shape for image in images])
        return [float(image[..., 0].mean()) / 255 for image in images]


def jpeg(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG")
    return out.getvalue()


async def test_images_are_brought_down_to_the_classifier_s_input_as_they_are_decoded_and_scored_alone(
    words: PromptFilter,
) -> None:
    """A 4096x4096 image was decoded whole and held with the call's others until all
    were scored together: 48 MiB each. Now each is decoded at (or brought down to)
    the classifier's input as it is read, and scored on its own."""
    Seen.calls = []
    limits = Limits(max_text_chars=20, max_image_bytes=2**20, threshold=0.5)
    moderator = Moderator(words, limits, Seen)
    large = [png((4096, 4096), (255, 0, 0)), jpeg((4096, 2048), (51, 0, 0)), png((300, 200), (255, 0, 0))]
    request = pb.ModerateRequest(inputs=[pb.ModerationInput(image=data) for data in large])
    red, dark, small = (await moderator.moderate(request)).results
    assert Seen.calls == [[(CLASSIFIER_SIZE, CLASSIFIER_SIZE, 3)]] * 3
    assert red.category_scores["sexual"] == pytest.approx(1.0) and small.category_scores["sexual"] == pytest.approx(1.0)
    assert dark.category_scores["sexual"] == pytest.approx(0.2, abs=0.01)
