"""What goes over the wire besides the routes' logic: a request's key and fields,
and a server-sent event written."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from http_api.errors import HttpError, bad_request


async def fields_of(request: web.Request) -> dict[str, Any]:
    """A form's fields (files as their FileField), or a JSON object's."""
    if request.content_type == "application/json":
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad_request("body", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise bad_request("body", "the body must be a JSON object")
        return body
    try:
        return dict(await request.post())
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, "the body is too large", kind="invalid_request_error", param="body") from None
    except ValueError as exc:
        raise bad_request("body", f"the body is not a form: {exc}") from None


def key_of(request: web.Request) -> str:
    """The caller's key, from ``Authorization: Bearer <key>``; empty without one."""
    presented = request.headers.get("Authorization", "")
    return presented.removeprefix("Bearer ").strip() if presented.startswith("Bearer ") else ""


def metadata_of(request: web.Request) -> list[tuple[str, str]] | None:
    """The caller's key as gRPC metadata for the gateway."""
    key = key_of(request)
    return [("authorization", f"Bearer {key}")] if key else None


async def open_events(request: web.Request) -> web.StreamResponse:
    """A response of server-sent events, its headers sent."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send_error_event(response: web.StreamResponse, error: HttpError) -> None:
    """A refusal after the events began: OpenAI's error shape, as an ``error`` event."""
    await send_event(response, {"error": {"message": error.message, "type": error.kind, "code": error.code}})


async def send_event(response: web.StreamResponse, event: dict[str, Any]) -> None:
    """One server-sent event, named by its ``type`` (``error`` without one)."""
    kind = event.get("type", "error")
    await response.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
