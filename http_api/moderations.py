"""OpenAI's moderations API (``POST /v1/moderations``) in Darkroom's terms: the
body's ``input`` as a ``ModerateRequest`` (each mistake a 400 naming its
parameter), and the gateway's results as OpenAI's moderation object. Pure.

- a string: one input, one result;
- an array of strings: one input and one result each;
- an array of parts (``{"type": "text", "text": ...}`` and ``{"type":
  "image_url", "image_url": {"url": "data:image/png;base64,..."}}``): one input
  to the gateway each and, as OpenAI answers such an array, one result for them
  all: flagged if any part is, each category flagged if any part's is, its score
  the highest of its parts', and ``category_applied_input_types`` naming the kinds
  of part (text, image) it was checked on.

Every input is counted (MAX_INPUTS) and measured (``Limits``: the gateway's own)
before any is converted: a small body must not become a large request.

An image comes in the request as a data: URL: the gateway fetches nothing, so a
remote URL is refused. ``model`` is taken and not acted on (a client written for
OpenAI's sends one): the answer names Darkroom's own, MODEL.

The answer holds every category OpenAI's schema requires (a client generated from
it rejects one without them). Darkroom checks ``sexual`` (texts and images) and
its own ``profanity`` (texts); each other is false, scored 0, and applied to no
input (``[]``: how OpenAI says a category was not checked)."""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from http_api.errors import bad_request, quoted
from http_api.images import Fields
from services.moderation import MAX_INPUTS
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

MODEL = "darkroom-moderation"
# The categories of OpenAI's moderation object (its OpenAPI schema requires each).
OPENAI_CATEGORIES = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/instructions",
    "self-harm/intent",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),(.*)", re.DOTALL)
_FIELD = re.compile(r"inputs(?:\[(\d+)\](?:\.(text|image))?)?")


@dataclass(frozen=True)
class Limits:
    """What the gateway takes of one input (DARKROOM_MAX_PROMPT_CHARS,
    DARKROOM_MAX_INPUT_MB), checked here before anything is converted."""

    max_text_chars: int
    max_image_bytes: int


@dataclass(frozen=True)
class Asked:
    """The gateway's request, and how its results answer the caller's."""

    request: pb.ModerateRequest
    form: str  # "string", "strings" or "parts": how ``input`` was given
    groups: tuple[tuple[int, ...], ...]  # the inputs each result combines, in order


def moderation(body: Any, limits: Limits) -> Asked:
    """The request a moderations body asks for; HttpError (400) naming the first
    bad parameter. Decodes images' base64: blocking."""
    if not isinstance(body, dict):
        raise bad_request("body", "the body must be a JSON object")
    given = body.get("input")
    take = Fields({name: value for name, value in body.items() if name != "input"}, form=False)
    take.text("model")
    take.done()
    if isinstance(given, str):
        text = _text(given, "input", limits)
        return Asked(pb.ModerateRequest(inputs=[pb.ModerationInput(text=text)]), "string", ((0,),))
    if not isinstance(given, list) or not given:
        raise bad_request("input", "input is required: a string, an array of strings, or an array of parts")
    if len(given) > MAX_INPUTS:
        raise bad_request("input", f"input holds {len(given)} inputs; at most {MAX_INPUTS} are taken")
    if all(isinstance(item, str) for item in given):
        texts = [_text(item, f"input[{i}]", limits) for i, item in enumerate(given)]
        inputs = [pb.ModerationInput(text=text) for text in texts]
        return Asked(pb.ModerateRequest(inputs=inputs), "strings", tuple((i,) for i in range(len(inputs))))
    parts = [_part(item, f"input[{i}]", limits) for i, item in enumerate(given)]
    inputs = [
        pb.ModerationInput(text=value) if kind == "text" else pb.ModerationInput(image=_decoded(value, param))
        for kind, value, param in parts
    ]
    return Asked(pb.ModerateRequest(inputs=inputs), "parts", (tuple(range(len(inputs))),))


def _text(value: str, param: str, limits: Limits) -> str:
    if len(value) > limits.max_text_chars:
        raise bad_request(
            param,
            f"{param} is {len(value)} characters; the limit is {limits.max_text_chars} (DARKROOM_MAX_PROMPT_CHARS)",
        )
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate, as JSON may escape one
        raise bad_request(param, f"{param} is not Unicode text: {quoted(value)}") from None
    return value


def _part(item: Any, param: str, limits: Limits) -> tuple[str, str, str]:
    """The part's kind, its text or its image's base64, and its parameter; checked, nothing decoded."""
    if not isinstance(item, dict):
        raise bad_request(param, f'{param} must be a part ({{"type": "text" or "image_url", ...}}) like the rest')
    kind = item.get("type")
    if kind == "text":
        text = item.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{param}.text", f"{param}.text must be a string")
        return "text", _text(text, f"{param}.text", limits), f"{param}.text"
    if kind == "image_url":
        image_url = item.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else None
        if not isinstance(url, str):
            raise bad_request(f"{param}.image_url", f'{param}.image_url must be {{"url": "data:image/png;base64,..."}}')
        return "image", _base64_of(url, f"{param}.image_url", limits.max_image_bytes), f"{param}.image_url"
    raise bad_request(f"{param}.type", f"{param}.type {quoted(kind)} is not text or image_url")


def _base64_of(url: str, param: str, max_bytes: int) -> str:
    """The base64 a data: URL holds, once the image it spells is within ``max_bytes``;
    400 for a remote URL (nothing is fetched), another URL, or a larger image."""
    if url.startswith(("http://", "https://")):
        raise bad_request(
            param,
            f"{param}: remote images are not fetched; send the image itself as a data: URL (data:image/png;base64,...)",
        )
    match = _DATA_URL.fullmatch(url)
    if match is None or ";base64" not in match[2]:
        raise bad_request(param, f"{param} is not a base64 data: URL (data:image/png;base64,...): {quoted(url)}")
    encoded = "".join(match[3].split())
    size = len(encoded) * 3 // 4 - encoded[-2:].count("=")
    if size > max_bytes:
        limit = f"{max_bytes} ({max_bytes / 2**20:g} MiB, DARKROOM_MAX_INPUT_MB)"
        raise bad_request(param, f"{param} is {size} bytes; the limit is {limit}")
    return encoded


def _decoded(encoded: str, param: str) -> bytes:
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(param, f"{param}: the data URL's base64 does not decode") from None


def param_of(field: str, asked: Asked) -> str:
    """The caller's parameter that the gateway's ``field`` (``inputs[2].image``) names."""
    match = _FIELD.fullmatch(field)
    if match is None:
        return field
    index, sub = match[1], match[2]
    if index is None or asked.form == "string":
        return "input"
    if asked.form == "strings" or sub is None:
        return f"input[{index}]"
    return f"input[{index}].{'text' if sub == 'text' else 'image_url'}"


def response(results: Sequence[pb.ModerationResult], asked: Asked) -> dict[str, Any]:
    """OpenAI's moderation object: one result per string, or one for an array of parts."""
    kinds = [one.WhichOneof("input") or "text" for one in asked.request.inputs]
    return {
        "id": f"modr-{uuid.uuid4().hex}",
        "model": MODEL,
        "results": [_combined([(results[i], kinds[i]) for i in group]) for group in asked.groups],
    }


def _combined(parts: list[tuple[pb.ModerationResult, str]]) -> dict[str, Any]:
    categories = dict.fromkeys(OPENAI_CATEGORIES, False)
    scores = dict.fromkeys(OPENAI_CATEGORIES, 0.0)
    applied: dict[str, set[str]] = {name: set() for name in OPENAI_CATEGORIES}
    for result, kind in parts:
        for name, flagged in result.categories.items():
            categories[name] = categories.get(name, False) or flagged
            applied.setdefault(name, set()).add(kind)
        for name, score in result.category_scores.items():
            scores[name] = max(scores.get(name, 0.0), round(score, 6))  # float32 on the wire: 0.30000001
    return {
        "flagged": any(result.flagged for result, _ in parts),
        "categories": dict(sorted(categories.items())),
        "category_scores": dict(sorted(scores.items())),
        "category_applied_input_types": {name: sorted(applied[name]) for name in sorted(applied)},
    }
