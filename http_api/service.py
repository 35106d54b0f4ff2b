"""The HTTP front door: OpenAI's images API (``/v1/images/generations``,
``/v1/images/edits``, ``/v1/models``) and videos API (``/v1/videos``: create,
retrieve, content) over the same jobs, keys and tenants as the
gRPC gateway, whose client it is; ``/v1/jobs/{id}`` to follow a job that a
``Prefer: respond-async`` request left running; ``/v1/files/...`` for the signed
links to results.

aiohttp serves it: one maintained package (aio-libs) with its own C HTTP parser,
multipart reading with a size limit and streamed responses, on the asyncio loop
the rest of Darkroom runs on, with no ASGI layer between."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware

from http_api.errors import HttpError, bad_request, from_rpc, too_large, unexpected
from http_api.gateway_client import Gateway, channel_to
from http_api.limits import JSON_BODY_BYTES, Door
from http_api.routes import Api
from http_api.signed_urls import UrlSigner, load_key
from http_api.wire import ACCEPTED, STREAMING
from services.config.http import HttpSettings
from services.config.sections import KernelSettings
from services.db.repository import Repository
from services.ops.host import Closing, Metrics, Part, host
from services.ops.lifecycle import run_service

log = logging.getLogger(__name__)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def openai_errors(door: Door) -> Middleware:
    """Limits before work (``limits.Door``: the body's size and the caller), then
    the route; every error as OpenAI's error JSON, whatever raised it (the
    unexpected ones logged with their traceback, and answered 500). Once the
    request's job was accepted, its errors name the job and ask not to be retried."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        served = request
        try:
            served = await door.admit(request)
            return await handler(served)
        except Exception as exc:
            error = _as_error(exc, door.limit_of(request))
            if error is None:
                raise
            events = served.get(STREAMING)
            if events is not None:  # the answer began: its error can no longer be one
                log.warning("a stream broke off: %s", exc, exc_info=error.status >= 500)
                return events
            accepted = served.get(ACCEPTED)
            if accepted is not None:
                error.after_submit(accepted)
            return error.response()

    return middleware


def _as_error(exc: Exception, limit: int | None) -> HttpError | None:
    """``exc`` as the error to answer; None for what is no error (a redirect)."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return from_rpc(exc)
    if isinstance(exc, web.HTTPException):
        if exc.status == 413:
            return too_large(limit or JSON_BODY_BYTES)
        if exc.status < 400:
            return None
        return HttpError(exc.status, exc.reason, kind="invalid_request_error")
    if isinstance(exc, HttpProcessingError):  # a body that breaks HTTP's own rules (its chunks, say)
        return bad_request("body", f"the body is malformed: {exc.message[:200]}")
    if isinstance(exc, ConnectionResetError):  # the caller left: nobody reads the answer
        log.info("the caller left: %s", exc)
        return unexpected()
    log.exception("unexpected error answering a request", exc_info=exc)
    return unexpected()


def create_app(settings: HttpSettings, gateway: Gateway, signer: UrlSigner, repo: Repository | None) -> web.Application:
    api = Api(settings, gateway, signer, repo)
    door = Door(gateway, api.body_limits())
    app = web.Application(middlewares=[openai_errors(door)], client_max_size=JSON_BODY_BYTES)
    app.add_routes(api.routes())
    return app


class HttpServer:
    """The app on its port; stopping, it closes the port, then lets requests under way end."""

    name = "HTTP server"

    def __init__(self, app: web.Application, host: str, port: int, *, grace_s: float) -> None:
        self.runner = web.AppRunner(app, shutdown_timeout=grace_s, access_log=None)
        self.host, self.port = host, port

    async def start(self, stop: asyncio.Event) -> bool:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return True

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve(kernel: KernelSettings, settings: HttpSettings, stop: asyncio.Event) -> int:
    gateway = Gateway(channel_to(settings.gateway, settings.gateway_tls_ca))
    signer = UrlSigner(load_key(settings.url_key_file), settings.url_ttl_s)
    repo = (
        Repository(kernel.database_url, pool_size=4, application_name="darkroom-http", pooled=kernel.database_pooled)
        if kernel.database_url
        else None
    )
    server = HttpServer(
        create_app(settings, gateway, signer, repo), settings.host, settings.port, grace_s=kernel.shutdown_grace_s
    )
    parts: list[Part] = [Metrics(kernel, "http"), Closing("gateway channel", gateway.close), server]
    if repo is not None:
        parts.insert(1, Closing("database", repo.close))

    async def work() -> int:
        log.info("http listening on %s:%d, for the gateway at %s", settings.host, server.port, settings.gateway)
        await stop.wait()
        return 0

    return await host(parts, work, stop)


def main() -> None:
    run_service("http", serve, HttpSettings)
