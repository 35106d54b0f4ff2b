"""A signed link's file (``/v1/files/{job_id}/{index}``): the link is its own
authority (``signed_urls``), checked before the output is read from the store."""

from __future__ import annotations

import time

from aiohttp import web

from http_api.errors import HttpError, bad_request, not_found, withheld
from http_api.signed_urls import UrlSigner, malformed
from http_api.wire import job_id_of
from services.db.repository import Repository
from services.errors import StoreError
from services.safety.verdicts import BLOCKED


async def serve(request: web.Request, signer: UrlSigner, repo: Repository | None) -> web.Response:
    job_id, index = job_id_of(request), request.match_info["index"]
    if not (index.isascii() and index.isdigit() and len(index) <= 6):
        raise not_found("output")
    expires, signature = request.query.get("expires", ""), request.query.get("signature", "")
    bad = malformed(expires, signature)
    if bad is not None:
        raise bad_request(*bad)
    why = signer.refusal(job_id, int(index), expires, signature, time.time())
    if why:
        raise HttpError(403, why, kind="permission_error", code="invalid_signature")
    if repo is None:
        raise HttpError(503, "this replica reads no outputs", kind="server_error")
    try:
        [found] = await repo.jobs.many_with_images([job_id])
    except StoreError as exc:
        raise HttpError(503, f"the store is away: {exc}", kind="server_error", code="service_unavailable") from exc
    outputs = found[1] if found is not None else []
    output = next((o for o in outputs if o.index == int(index)), None)
    if output is None:
        raise not_found("output")
    if output.verdict == BLOCKED:
        raise withheld(job_id, f"output {index}")
    return web.Response(body=output.data, content_type=output.mime_type, headers={"Cache-Control": "private"})
