"""The HTTP front door: OpenAI's images API (``/v1/images/generations``,
``/v1/images/edits``, ``/v1/models``) over the same jobs, keys and tenants as the
gRPC gateway, whose client it is; ``/v1/jobs/{id}`` to follow a job that a
``Prefer: respond-async`` request left running; ``/v1/files/...`` for the signed
links to results.

aiohttp serves it: one maintained package (aio-libs) with its own C HTTP parser,
multipart reading with a size limit and streamed responses, on the asyncio loop
the rest of Darkroom runs on, with no ASGI layer between."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import grpc
from aiohttp import web

from http_api import images
from http_api.errors import HttpError, bad_request, from_rpc
from http_api.gateway_client import Gateway, channel_to, default_model
from http_api.signed_urls import UrlSigner, load_key
from services.config.http import HttpSettings
from services.config.sections import KernelSettings
from services.db.repository import Repository
from services.errors import StoreError
from services.ops.host import Closing, Metrics, Part, host
from services.ops.lifecycle import run_service
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

log = logging.getLogger(__name__)

STATUS_NAMES = {value: name.removeprefix("JOB_STATUS_").lower() for name, value in pb.JobStatus.items()}
# The largest request body: an edit's image and mask at the gateway's limit, and the form around them.
MAX_BODY_BYTES = 50 * 2**20


class Api:
    """The routes, over a gateway client, the signer of links and the store the
    linked outputs are read from."""

    def __init__(self, settings: HttpSettings, gateway: Gateway, signer: UrlSigner, repo: Repository | None) -> None:
        self.settings, self.gateway, self.signer, self.repo = settings, gateway, signer, repo

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/images/generations", self.generations),
            web.post("/v1/images/edits", self.edits),
            web.get("/v1/models", self.models),
            web.get("/v1/jobs/{job_id}", self.job),
            web.get("/v1/files/{job_id}/{index}", self.file),
        ]

    async def generations(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad_request("body", "the body is not JSON") from None
        submit, asked = images.generation(body)
        return await self._run(request, submit, asked, "image")

    async def edits(self, request: web.Request) -> web.Response:
        try:
            form = await request.post()
        except web.HTTPRequestEntityTooLarge:
            too_large = f"the body is over {MAX_BODY_BYTES} bytes"
            raise HttpError(413, too_large, kind="invalid_request_error", param="body") from None
        except (ValueError, web.HTTPException) as exc:
            raise bad_request("body", f"the body is not a multipart form: {exc}") from None
        files = {name: form[name] for name in ("image", "image[]", "mask") if name in form}
        fields = {name: value for name, value in form.items() if name not in files}
        submit, asked = images.generation(fields, form=True)
        image = files.get("image") or files.get("image[]")
        if not isinstance(image, web.FileField):
            raise bad_request("image", "image is required: the picture to edit, as a file")
        submit.image = image.file.read()
        mask = files.get("mask")
        if mask is not None:
            if not isinstance(mask, web.FileField):
                raise bad_request("mask", "mask must be a file")
            submit.mask = mask.file.read()
        return await self._run(request, submit, asked, "image")

    async def _run(
        self, request: web.Request, submit: pb.SubmitJobRequest, asked: images.Asked, kind: str
    ) -> web.Response:
        key = _key(request)
        if not submit.model:
            submit.model = default_model(await self.gateway.models(key), kind)
        submitted = await self.gateway.submit(submit, key)
        left_running = web.json_response(
            self._job_json(request, submitted.job_id, STATUS_NAMES[submitted.status]), status=202
        )
        if "respond-async" in request.headers.get("Prefer", ""):
            return left_running
        try:
            done = await self.gateway.finished(submitted.job_id, key, self.settings.wait_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return left_running  # too long to wait for: the caller follows it
        job = done.job
        if job.status != pb.JOB_STATUS_SUCCEEDED:
            what = STATUS_NAMES[job.status]
            raise HttpError(500, f"job {job.job_id} ended {what}: {job.error}", kind="server_error", code=f"job_{what}")
        now = time.time()
        body = images.images_response(job, done.outputs, asked, lambda i: self._link(request, job.job_id, i, now))
        return web.json_response(body)

    async def models(self, request: web.Request) -> web.Response:
        found = await self.gateway.stub.ListModels(pb.ListModelsRequest(), metadata=_metadata(request), timeout=30)
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": 0,
                "owned_by": "darkroom",
                "capability": m.capability,
                "default": m.is_default,
            }
            for m in found.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def job(self, request: web.Request) -> web.Response:
        job = await self.gateway.get(request.match_info["job_id"], _key(request))
        body = self._job_json(request, job.job_id, STATUS_NAMES[job.status])
        now = time.time()
        body.update(
            model=job.model,
            created=job.timings.created_time.seconds,
            progress={"step": job.progress.step, "total": job.progress.total},
            error=job.error or None,
            usage=images.usage(job),
        )
        if job.status == pb.JOB_STATUS_SUCCEEDED:
            body["data"] = [{"url": self._link(request, job.job_id, i, now)} for i in range(len(job.images))]
        return web.json_response(body)

    async def file(self, request: web.Request) -> web.Response:
        job_id, index = request.match_info["job_id"], request.match_info["index"]
        if not index.isdigit():
            raise HttpError(404, "no such output", kind="invalid_request_error", code="not_found")
        why = self.signer.refusal(
            job_id, int(index), request.query.get("expires", ""), request.query.get("signature", ""), time.time()
        )
        if why:
            raise HttpError(403, why, kind="permission_error", code="invalid_signature")
        if self.repo is None:
            raise HttpError(503, "this replica reads no outputs", kind="server_error")
        try:
            [found] = await self.repo.jobs.many_with_images([job_id])
        except StoreError as exc:
            raise HttpError(503, f"the store is away: {exc}", kind="server_error", code="service_unavailable") from exc
        outputs = found[1] if found is not None else []
        output = next((o for o in outputs if o.index == int(index)), None)
        if output is None:
            raise HttpError(404, "no such output", kind="invalid_request_error", code="not_found")
        return web.Response(body=output.data, content_type=output.mime_type, headers={"Cache-Control": "private"})

    def _job_json(self, request: web.Request, job_id: str, status: str) -> dict[str, Any]:
        return {
            "id": job_id,
            "object": "darkroom.job",
            "status": status,
            "url": f"{self._base(request)}/v1/jobs/{job_id}",
        }

    def _link(self, request: web.Request, job_id: str, index: int, now: float) -> str:
        return self._base(request) + self.signer.path(job_id, index, now)

    def _base(self, request: web.Request) -> str:
        return self.settings.public_url.rstrip("/") or f"{request.scheme}://{request.host}"


def _key(request: web.Request) -> str:
    presented = request.headers.get("Authorization", "")
    return presented.removeprefix("Bearer ").strip() if presented.startswith("Bearer ") else ""


def _metadata(request: web.Request) -> list[tuple[str, str]] | None:
    key = _key(request)
    return [("authorization", f"Bearer {key}")] if key else None


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal as OpenAI's error JSON."""
    try:
        return await handler(request)
    except HttpError as exc:
        return exc.response()
    except grpc.aio.AioRpcError as exc:
        return from_rpc(exc).response()
    except web.HTTPException as exc:
        if exc.status == 413:
            return HttpError(413, "the request is too large", kind="invalid_request_error", param="body").response()
        if exc.status >= 400:
            return HttpError(exc.status, exc.reason, kind="invalid_request_error").response()
        raise


def create_app(settings: HttpSettings, gateway: Gateway, signer: UrlSigner, repo: Repository | None) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=MAX_BODY_BYTES)
    app.add_routes(Api(settings, gateway, signer, repo).routes())
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
        Repository(kernel.database_url, pool_size=4, application_name="darkroom-http") if kernel.database_url else None
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
