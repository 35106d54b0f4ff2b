"""Limits before work: a route's body is read only up to that route's limit, and
only once the gateway admits the caller.

- Each route that takes a body has a limit: a JSON request (a generation, a
  video) ``JSON_BODY_BYTES``, an edit's form an image and its mask at the
  gateway's input limit (``DARKROOM_MAX_INPUT_MB``) and the fields around them, an
  adapter's upload its file at the gateway's (``DARKROOM_MAX_ADAPTER_MB``) and its
  fields (the file read as it streams, ``adapter_upload``), a
  moderation its 32 inputs: texts at the gateway's longest, escaped, and images as
  much as an edit's in base64 (inline). A declared
  ``Content-Length`` over it is refused (413) before a byte of the body is read;
  a body without one is refused as soon as it passes the limit.
- Before a body is read, the caller's key (or its absence) is shown to the gateway
  with a ``ListModels`` call: while tenants (or ``DARKROOM_API_KEYS``) exist, a
  request without a key, or with a key the gateway does not know, is refused (401)
  there. A key the gateway admitted is remembered (as its SHA-256) for
  ``ADMITTED_FOR_S``, so this costs at most one call a second per key, and a
  revoked key is refused within that second and the gateway's own."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping

from aiohttp import web

from http_api.errors import too_large
from http_api.gateway_client import Gateway
from http_api.wire import key_of
from services.moderation import MAX_INPUTS

JSON_BODY_BYTES = 2**20
# An edit's form around its image and mask: the prompt and the other fields.
FORM_FIELDS_BYTES = 2**20
# A moderation's part around its text or image (its type, its keys, spaces).
PART_BYTES = 512
# A character as JSON may spell it at its longest: past U+FFFF, \ud83d\ude00.
ESCAPED_CHAR_BYTES = 12
ADMITTED_FOR_S = 1.0
# The keys remembered at once; past this, those admitted longest ago are forgotten.
MAX_ADMITTED = 4096


def upload_bytes(max_input_mb: float) -> int:
    """The largest edit's body: an image and its mask of ``max_input_mb`` each, and the form's fields."""
    return 2 * int(max_input_mb * 2**20) + FORM_FIELDS_BYTES


def adapter_upload_bytes(max_adapter_mb: float) -> int:
    """The largest adapter upload's body: its file of ``max_adapter_mb``, and the form's fields."""
    return int(max_adapter_mb * 2**20) + FORM_FIELDS_BYTES


def moderation_bytes(max_input_mb: float, max_prompt_chars: int) -> int:
    """The largest moderation's body: its 32 inputs (MAX_INPUTS) as parts, texts at
    the gateway's longest with every character escaped at its longest, and images of
    an edit's body in all (two of ``max_input_mb``) in base64, a third larger; their
    bytes then fit one gRPC message. Parsing it makes no more than a body's values
    (``wire.MAX_JSON_VALUES``), whatever its size."""
    parts = MAX_INPUTS * (PART_BYTES + ESCAPED_CHAR_BYTES * max_prompt_chars)
    return parts + 4 * (2 * int(max_input_mb * 2**20)) // 3


class Door:
    """Each request's body limit (by the route's path, for the methods that take a
    body), and the callers the gateway admitted lately."""

    def __init__(
        self, gateway: Gateway, limits: Mapping[str, int], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.gateway, self.limits, self.clock = gateway, dict(limits), clock
        self._admitted: dict[bytes, float] = {}

    def limit_of(self, request: web.Request) -> int | None:
        """The body limit of ``request``'s route; None for a request that takes no body."""
        resource = request.match_info.route.resource
        if request.method != "POST" or resource is None:
            return None
        return self.limits.get(resource.canonical)

    async def admit(self, request: web.Request) -> web.Request:
        """``request`` with its route's body limit, once its size and its caller
        pass; HttpError (413, 401) or the gateway's refusal otherwise."""
        limit = self.limit_of(request)
        if limit is None:
            return request
        if request.content_length is not None and request.content_length > limit:
            raise too_large(limit)
        await self._caller(key_of(request))
        return request.clone(client_max_size=limit)

    async def _caller(self, key: str) -> None:
        digest = hashlib.sha256(key.encode()).digest()
        now = self.clock()
        admitted_at = self._admitted.get(digest)
        if admitted_at is not None and now - admitted_at < ADMITTED_FOR_S:
            return
        await self.gateway.check(key)  # the gateway's refusal (UNAUTHENTICATED: 401) propagates
        if len(self._admitted) >= MAX_ADMITTED:
            self._admitted = {d: at for d, at in self._admitted.items() if now - at < ADMITTED_FOR_S}
            while len(self._admitted) >= MAX_ADMITTED:
                del self._admitted[next(iter(self._admitted))]
        self._admitted[digest] = now
