"""What goes over the wire besides the routes' logic: a request's key, its
idempotency key, its preferences and its body (JSON or a form, each bad one a 400
naming it, never a 500; JSON's values counted before it is parsed, off the event
loop), and server-sent events written."""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from http_api.errors import HttpError, bad_request, quoted, unauthenticated
from services.db.records import MAX_IDEMPOTENCY_KEY, MAX_JOB_ID

# The longest API key taken.
MAX_KEY_CHARS = 512
# The values (strings, numbers, arrays, objects) a JSON body may hold: many times
# what any route takes (a moderation's 32 parts are about 200), and few enough
# that parsing a body at its route's limit makes no more Python objects than that.
MAX_JSON_VALUES = 1024
# A JSON string, escapes and all, or (group 1) what opens or separates values.
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]++|\\.)*+"|([\[{,:])', re.DOTALL)
# The longest integer a JSON body may spell out: any parameter's range fits in far
# fewer digits, and Python refuses to convert more than 4,300.
MAX_INTEGER_DIGITS = 40
# The key under which a request records the job it made (``errors.HttpError.after_submit``).
ACCEPTED = "darkroom.accepted_job"
# The key under which a request records that its events began (its errors go in them).
STREAMING = "darkroom.events"


@dataclass(frozen=True)
class LongInteger:
    """A JSON integer too long to be any parameter's value, kept unconverted."""

    digits: int

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def _integer(text: str) -> int | LongInteger:
    return int(text) if len(text) <= MAX_INTEGER_DIGITS else LongInteger(len(text.lstrip("-")))


async def json_body(request: web.Request) -> Any:
    """The body as JSON, read to the route's limit (413 beyond it), parsed in a
    thread (``parse_json``): a body at a moderation's limit is tens of MiB."""
    raw = await request.read()
    return await asyncio.to_thread(parse_json, raw)


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON; 400 naming ``body`` when it holds more than MAX_JSON_VALUES
    values (told before a value is made: a parser makes an object of each, and a
    small body can hold millions) or is not JSON (bad UTF-8, nested past Python's
    recursion limit). Blocking."""
    # Every value but the first follows a `[`, `{`, `,` or `:` outside a string, so
    # counting those (each string skipped whole, escapes and all) bounds the values.
    structural = 0
    for token in _JSON_TOKENS.finditer(raw):
        if token.lastindex:
            structural += 1
            if structural >= MAX_JSON_VALUES:
                raise bad_request(
                    "body",
                    f"the body holds more than {MAX_JSON_VALUES} JSON values (strings, numbers, arrays, objects); "
                    "no request takes that many (a moderation: 32 inputs at most)",
                )
    try:
        return json.loads(raw, parse_int=_integer)
    except (ValueError, RecursionError) as exc:
        raise bad_request("body", f"the body is not JSON: {str(exc)[:200]}") from None


async def form_body(request: web.Request) -> dict[str, Any]:
    """A form's fields (files as their FileField), read to the route's limit."""
    try:
        return dict(await request.post())
    except web.HTTPRequestEntityTooLarge:
        raise  # the route's limit: answered as such
    # LookupError: a part's unknown charset; HttpProcessingError: a part's malformed headers.
    except (ValueError, LookupError, HttpProcessingError, web.HTTPException) as exc:
        raise bad_request("body", f"the body is not a form: {str(exc)[:200]}") from None


async def fields_of(request: web.Request) -> dict[str, Any]:
    """A form's fields (files as their FileField), or a JSON object's."""
    if request.content_type != "application/json":
        return await form_body(request)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise bad_request("body", "the body must be a JSON object")
    return body


def key_of(request: web.Request) -> str:
    """The caller's key, from ``Authorization: Bearer <key>``; empty without one;
    401 for one that no key could be (gRPC metadata is printable ASCII)."""
    presented = request.headers.get("Authorization", "")
    if not presented.startswith("Bearer "):
        return ""
    key = presented.removeprefix("Bearer ").strip()
    if len(key) > MAX_KEY_CHARS or not (key.isascii() and key.isprintable()):
        raise unauthenticated("the API key is malformed: a Darkroom key is printable ASCII (drk_<id>_<secret>)")
    return key


def metadata_of(request: web.Request) -> list[tuple[str, str]] | None:
    """The caller's key as gRPC metadata for the gateway."""
    key = key_of(request)
    return [("authorization", f"Bearer {key}")] if key else None


def idempotency_key(request: web.Request) -> str:
    """The request's ``Idempotency-Key``, or one made for it: the submits this
    replica makes for the request (a retry after a lost answer) are then one job."""
    given = request.headers.get("Idempotency-Key")
    if given is None:
        return f"http-{uuid.uuid4().hex}"
    if not 0 < len(given) <= MAX_IDEMPOTENCY_KEY or not (given.isascii() and given.isprintable()):
        raise bad_request(
            "Idempotency-Key",
            f"Idempotency-Key {quoted(given)} is not 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
        )
    return given


@dataclass(frozen=True)
class Wait:
    """How long a request waits for its job, and what it gets past that: the job to
    follow (202) when it prefers ``respond-async``, else an error naming the job."""

    seconds: float
    respond_async: bool


def wait_of(request: web.Request, wait_s: float) -> Wait:
    """``Prefer: respond-async`` (RFC 7240) answers at once, ``respond-async, wait=N``
    after at most N seconds; otherwise the request waits up to ``wait_s``, and less
    than the read timeout an OpenAI SDK announces (``x-stainless-read-timeout``), so
    that the answer reaches it before it gives up and submits again. Malformed
    preferences are ignored, as RFC 7240 asks."""
    tokens = [part.strip().lower() for part in request.headers.get("Prefer", "").replace(";", ",").split(",")]
    respond_async = "respond-async" in tokens
    seconds = wait_s
    if respond_async:
        seconds = 0.0
        for token in tokens:
            name, _, value = token.partition("=")
            if name.strip() == "wait" and value.strip().isascii() and value.strip().isdigit():
                seconds = min(wait_s, float(value.strip()[:7]))
    client_timeout = _seconds(request.headers.get("x-stainless-read-timeout", ""))
    if client_timeout is not None:
        seconds = min(seconds, max(0.5, client_timeout - max(1.0, 0.05 * client_timeout)))
    return Wait(seconds, respond_async)


def _seconds(text: str) -> float | None:
    try:
        value = float(text) if len(text) <= 32 else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def job_id_of(request: web.Request) -> str:
    """The job named in the path; 404 for one that no job id could be."""
    job_id = request.match_info["job_id"]
    if not 0 < len(job_id) <= MAX_JOB_ID or not (job_id.isascii() and job_id.isprintable()):
        raise HttpError(404, "no such job", kind="invalid_request_error", code="not_found")
    return job_id


async def open_events(request: web.Request) -> web.StreamResponse:
    """A response of server-sent events, its headers sent."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    request[STREAMING] = response
    return response


async def send_error_event(response: web.StreamResponse, error: HttpError) -> None:
    """A refusal after the events began: OpenAI's error shape, as an ``error`` event."""
    await send_event(response, {"type": "error", "error": error.body()})


async def send_event(response: web.StreamResponse, event: dict[str, Any]) -> None:
    """One server-sent event, named by its ``type``."""
    await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
