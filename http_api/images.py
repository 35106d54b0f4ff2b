"""OpenAI's images API in Darkroom's terms: a generation's JSON body, or an edit's
multipart form, as a ``SubmitJobRequest`` (each mistake a 400 naming its
parameter, before anything reaches the gateway), and a finished job as OpenAI's
images response (``created``, ``data`` with ``b64_json`` or a signed ``url``,
``usage`` with the GPU-seconds charged). Pure."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from http_api.errors import bad_request, quoted
from http_api.wire import LongInteger
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.verdicts import BLOCKED

FORMATS = {"png": pb.OUTPUT_FORMAT_PNG, "jpeg": pb.OUTPUT_FORMAT_JPEG, "webp": pb.OUTPUT_FORMAT_WEBP}
RESPONSE_FORMATS = ("b64_json", "url")
MAX_N = 10
MAX_ADAPTERS = 16  # a request's; a model takes its adapters_per_job
# OpenAI's own parameters Darkroom takes and does not act on (the model decides).
# Darkroom's own, beside OpenAI's: seed, steps, negative_prompt, guidance, strength, lane, expand_prompt,
# adapters.
IGNORED = ("quality", "style", "background", "moderation", "output_compression", "user", "safety_identifier")
_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")
# What a stream's events are named after: OpenAI's image_generation.* and image_edit.*.
STREAMS = {"generation": "image_generation", "edit": "image_edit"}


@dataclass(frozen=True)
class Asked:
    """What a request asks of the answer, beside the job."""

    response_format: str = "b64_json"
    stream: bool = False  # server-sent events: partial images, then the image


def generation(body: Any, *, form: bool = False) -> tuple[pb.SubmitJobRequest, Asked]:
    """The job and the answer a generation (or, ``form``, an edit's fields but its
    files) asks for; HttpError (400) naming the first bad parameter."""
    if not isinstance(body, Mapping):
        raise bad_request("body", "the body must be a JSON object")
    take = Fields(body, form)
    request = pb.SubmitJobRequest(prompt=take.text("prompt", required=True), model=take.text("model"))
    request.negative_prompt = take.text("negative_prompt")
    request.lane = take.text("lane")
    n = take.integer("n", 1, MAX_N)
    if n is not None:
        request.num_images = n
    size = take.text("size")
    if size and size != "auto":
        request.width, request.height = parse_size(size, "512x512", also=" or auto")
    fmt = take.text("output_format")
    if fmt:
        if fmt not in FORMATS:
            raise bad_request("output_format", f"output_format {fmt!r} is not one of {', '.join(FORMATS)}")
        request.output_format = FORMATS[fmt]
    for name, field_name, low, high in (("steps", "steps", 1, 1000), ("seed", "seed", 0, 2**63 - 1)):
        value = take.integer(name, low, high)
        if value is not None:
            setattr(request, field_name, value)
    guidance = take.number("guidance", 0.0, 50.0)
    if guidance is not None:
        request.guidance_scale = guidance
    strength = take.number("strength", 0.0, 1.0)
    if strength is not None:
        request.strength = strength
    request.adapters.extend(take.adapters("adapters"))
    expand = take.flag("expand_prompt")
    if expand is not None:  # unset: the tenant's default
        request.expand_prompt = expand
    response_format = take.text("response_format") or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise bad_request("response_format", f"response_format {response_format!r} is not url or b64_json")
    stream = bool(take.flag("stream"))
    partial = take.integer("partial_images", 0, 3)
    if stream:
        if request.num_images > 1:
            raise bad_request("n", "a streamed generation makes one image (n 1)")
        request.previews = partial or 0
    for name in IGNORED:
        if name == "output_compression":
            take.integer(name, 0, 100)
        else:
            take.text(name)
    take.done()
    return request, Asked(response_format, stream)


def parse_size(size: str, example: str, *, also: str = "") -> tuple[int, int]:
    """``WIDTHxHEIGHT`` in ASCII digits, each of at most five; 400 naming ``size`` otherwise."""
    match = _SIZE.fullmatch(size)
    if match is None:
        raise bad_request("size", f"size {quoted(size)} is not WIDTHxHEIGHT (e.g. {example}){also}")
    return int(match[1]), int(match[2])


def _kind_of(value: Any) -> str:
    return "integer" if isinstance(value, LongInteger) else type(value).__name__


class Fields:
    """A request's parameters, each taken once and checked for its type; what is
    left at the end is unknown."""

    def __init__(self, body: Mapping[str, Any], form: bool, prefix: str = "") -> None:
        self.left = dict(body)
        self.form = form  # a form's values are all strings
        self.prefix = prefix  # of a nested object's parameters' names: "adapters[0]."

    def _take(self, name: str) -> Any:
        return self.left.pop(name, None)

    def text(self, name: str, *, required: bool = False) -> str:
        value = self._take(name)
        if value is None or value == "":
            if required:
                raise bad_request(self.prefix + name, f"{self.prefix}{name} is required")
            return ""
        if not isinstance(value, str):
            raise bad_request(self.prefix + name, f"{self.prefix}{name} must be a string, not {_kind_of(value)}")
        try:
            value.encode()
        except UnicodeEncodeError:  # a lone surrogate, as JSON may escape one
            raise bad_request(self.prefix + name, f"{self.prefix}{name} is not Unicode text: {quoted(value)}") from None
        if "\x00" in value:  # which no text column of PostgreSQL holds
            raise bad_request(self.prefix + name, f"{self.prefix}{name} contains a NUL character: {quoted(value)}")
        return value

    def adapters(self, name: str) -> list[pb.Adapter]:
        """LoRA adapters: a list of {"name": "NAME[:VERSION]", "scale": number} (or of
        names alone, scale 1); in a form, that list as JSON text."""
        value = self._take(name)
        if value is None:
            return []
        if self.form and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(
                    self.prefix + name, f"{self.prefix}{name} must be a JSON list, not {quoted(value)}"
                ) from None
        if not isinstance(value, list) or len(value) > MAX_ADAPTERS:
            raise bad_request(
                self.prefix + name, f"{self.prefix}{name} must be a list of at most {MAX_ADAPTERS} adapters"
            )
        adapters = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                item = {"name": item}
            if not isinstance(item, Mapping) or set(item) - {"name", "scale"}:
                raise bad_request(f"{name}[{i}]", f'{name}[{i}] must be {{"name": ..., "scale": ...}}')
            entry = Fields(item, form=False, prefix=f"{name}[{i}].")
            adapter = pb.Adapter(name=entry.text("name", required=True))
            scale = entry.number("scale", -1e6, 1e6)  # the gateway says which scales a model takes
            if scale is not None:
                adapter.scale = scale
            adapters.append(adapter)
        return adapters

    def integer(self, name: str, low: int, high: int) -> int | None:
        return self._ranged(name, low, high, int)

    def number(self, name: str, low: float, high: float) -> float | None:
        return self._ranged(name, low, high, float)

    def flag(self, name: str) -> bool | None:
        value = self._take(name)
        if value is None:
            return None
        if self.form and isinstance(value, str) and value in ("true", "false"):
            return value == "true"
        if not isinstance(value, bool):
            raise bad_request(self.prefix + name, f"{self.prefix}{name} must be true or false")
        return value

    def _ranged(self, name: str, low: Any, high: Any, kind: Callable[[Any], Any]) -> Any:
        value = self._take(name)
        if value is None:
            return None
        if isinstance(value, LongInteger):
            raise bad_request(self.prefix + name, f"{self.prefix}{name} is outside {low}..{high}: {value!r}")
        if self.form and isinstance(value, str):
            text = value
            try:
                value = kind(text.strip()) if len(text) <= 64 else None
            except ValueError:
                value = None
            if value is None:
                raise bad_request(self.prefix + name, f"{self.prefix}{name} must be a number, not {quoted(text)}")
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or (kind is int and not float(value).is_integer()):
            what = "an integer" if kind is int else "a number"
            raise bad_request(self.prefix + name, f"{self.prefix}{name} must be {what}, not {quoted(value)}")
        if not low <= value <= high:
            raise bad_request(self.prefix + name, f"{self.prefix}{name} {value} is outside {low}..{high}")
        return kind(value)

    def done(self) -> None:
        for name in self.left:
            raise bad_request(str(name)[:64], f"unknown parameter {quoted(name)}")


def images_response(job: pb.Job, outputs: list[pb.Image], asked: Asked, link: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI's images response for a finished job: each output inline or as a
    signed link, those the image filter blocked left out (``returned``); ``usage``
    with the job's GPU-seconds and credits."""
    data = [
        {"url": link(i)} if asked.response_format == "url" else {"b64_json": base64.b64encode(o.data).decode()}
        for i, o in returned(outputs)
    ]
    if job.expanded_prompt:  # OpenAI's field for the prompt an image was made from
        for entry in data:
            entry["revised_prompt"] = job.expanded_prompt
    fmt = next((name for name, value in FORMATS.items() if value == job.output_format), "png")
    return {
        "created": job.timings.created_time.seconds,
        "data": data,
        "output_format": fmt,
        "size": f"{job.width}x{job.height}",
        "usage": usage(job),
    }


def returned(outputs: Sequence[pb.Image]) -> list[tuple[int, pb.Image]]:
    """The outputs a client gets, with their indexes: all but those the image filter
    blocked (withheld: no bytes). None of them: OpenAI's content_policy_violation."""
    return [(i, o) for i, o in enumerate(outputs) if o.verdict != BLOCKED]


def partial_event(preview: pb.Preview, index: int, job: pb.Job, stream: str) -> dict[str, Any]:
    """OpenAI's ``image_generation.partial_image`` (or, ``stream`` ``edit``,
    ``image_edit.partial_image``) event for a preview (a JPEG)."""
    return {
        "type": f"{STREAMS[stream]}.partial_image",
        "b64_json": base64.b64encode(preview.data).decode(),
        "created_at": job.timings.created_time.seconds,
        "size": f"{preview.width}x{preview.height}",
        "output_format": "jpeg",
        "quality": "auto",
        "background": "opaque",
        "partial_image_index": index,
    }


def completed_event(job: pb.Job, output: pb.Image, stream: str) -> dict[str, Any]:
    """OpenAI's ``image_generation.completed`` (or ``image_edit.completed``) event
    for a finished job's image."""
    fmt = next((name for name, value in FORMATS.items() if value == job.output_format), "png")
    return {
        "type": f"{STREAMS[stream]}.completed",
        "b64_json": base64.b64encode(output.data).decode(),
        "created_at": job.timings.created_time.seconds,
        "size": f"{job.width}x{job.height}",
        "output_format": fmt,
        "quality": "auto",
        "background": "opaque",
        "usage": usage(job),
    }


def usage(job: pb.Job) -> dict[str, Any]:
    """OpenAI's usage (no tokens: Darkroom charges GPU-seconds of sampling), with
    Darkroom's own: the GPU-seconds charged, and the credits once settled."""
    return {
        "input_tokens": 0,
        "output_tokens": 0,
        "total_tokens": 0,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
        "gpu_seconds": job.gpu_seconds,
        "credits": job.credits_charged if job.HasField("credits_charged") else None,
    }
