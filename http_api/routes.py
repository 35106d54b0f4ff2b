"""The HTTP API's routes: each turns a request into calls to the gateway (with the
caller's key), and their answers into OpenAI's shapes (``images``, ``videos``).
Here: the page, images made and edited (waited for, or streamed), moderations,
models, the fleet and the files; jobs followed are ``job_routes``', videos
``video_routes``', a tenant's adapters ``adapters``'."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from aiohttp import web

from http_api import files, fleet, images, moderations
from http_api.adapters import AdapterRoutes
from http_api.errors import (
    HttpError,
    bad_request,
    from_rpc,
    job_ended,
    still_running,
    submit_unanswered,
    withheld,
)
from http_api.gateway_client import Gateway, Outputs, default_model
from http_api.job_routes import STATUS_NAMES, JobRoutes
from http_api.limits import JSON_BODY_BYTES, adapter_upload_bytes, moderation_bytes, upload_bytes
from http_api.signed_urls import UrlSigner
from http_api.video_routes import VideoRoutes
from http_api.wire import (
    ACCEPTED,
    form_body,
    idempotency_key,
    json_body,
    key_of,
    metadata_of,
    open_events,
    send_error_event,
    send_event,
    wait_of,
)
from services.config.http import HttpSettings
from services.db.repository import Repository
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

# The page (no build step, nothing from elsewhere): read once.
PAGE = (Path(__file__).with_name("page.html")).read_bytes()


class Api:
    """The routes, over a gateway client, the signer of links and the store the
    linked outputs are read from."""

    def __init__(self, settings: HttpSettings, gateway: Gateway, signer: UrlSigner, repo: Repository | None) -> None:
        self.settings, self.gateway, self.signer, self.repo = settings, gateway, signer, repo
        self.job_routes = JobRoutes(settings, gateway, signer)
        self.moderation_limits = moderations.Limits(settings.max_prompt_chars, int(settings.max_input_mb * 2**20))

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/", self.page),
            web.post("/v1/images/generations", self.generations),
            web.post("/v1/images/edits", self.edits),
            web.get("/v1/models", self.models),
            web.post("/v1/moderations", self.moderations),
            web.get("/v1/fleet", self.fleet_view),
            web.get("/v1/files/{job_id}/{index}", self.file),
            *self.job_routes.routes(),
            *VideoRoutes(self.gateway, self._submit).routes(),
            *AdapterRoutes(self.gateway, self.settings.max_adapter_mb).routes(),
        ]

    def body_limits(self) -> dict[str, int]:
        """The largest body each route that takes one reads (``limits.Door``)."""
        return {
            "/v1/images/generations": JSON_BODY_BYTES,
            "/v1/images/edits": upload_bytes(self.settings.max_input_mb),
            "/v1/videos": JSON_BODY_BYTES,  # a form without files: an input reference is not served
            "/v1/moderations": moderation_bytes(self.settings.max_input_mb, self.settings.max_prompt_chars),
            "/v1/adapters": adapter_upload_bytes(self.settings.max_adapter_mb),  # its file read as it streams
        }

    async def page(self, request: web.Request) -> web.Response:
        """The page: a prompt box and a live view of the fleet, over this same API."""
        return web.Response(body=PAGE, content_type="text/html", headers={"Cache-Control": "no-cache"})

    async def generations(self, request: web.Request) -> web.StreamResponse:
        submit, asked = images.generation(await json_body(request))
        return await self._run(request, submit, asked, "generation")

    async def edits(self, request: web.Request) -> web.StreamResponse:
        form = await form_body(request)
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
        return await self._run(request, submit, asked, "edit")

    async def _submit(self, request: web.Request, submit: pb.SubmitJobRequest, key: str) -> pb.SubmitJobResponse:
        """The job stored (once, under the request's idempotency key), recorded on
        the request: every error answered from here on names it and is not to be
        retried."""
        submit.idempotency_key = idempotency_key(request)
        try:
            submitted = await self.gateway.submit(submit, key)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise submit_unanswered(submit.idempotency_key) from None
            raise
        request[ACCEPTED] = submitted.job_id
        return submitted

    async def _run(
        self, request: web.Request, submit: pb.SubmitJobRequest, asked: images.Asked, stream: str
    ) -> web.StreamResponse:
        key = key_of(request)
        if not submit.model:
            submit.model = default_model(await self.gateway.models(key), "image")
        wait = wait_of(request, self.settings.wait_s)
        began = time.perf_counter()
        submitted = await self._submit(request, submit, key)
        submitted_at = time.perf_counter()
        job_id = submitted.job_id
        if wait.respond_async and wait.seconds <= 0:
            return web.json_response(
                self.job_routes.job_json(request, job_id, STATUS_NAMES[submitted.status]), status=202
            )
        if asked.stream:
            return await self._stream(request, job_id, key, stream, wait.seconds)
        done = await self.gateway.finished(job_id, key, wait.seconds)
        if done is None:  # too long to wait for: the caller follows it
            if wait.respond_async:
                return web.json_response(
                    self.job_routes.job_body(request, await self.gateway.get(job_id, key)), status=202
                )
            raise still_running(job_id, self.job_routes.job_url(request, job_id), wait.seconds)
        job = done.job
        if job.status != pb.JOB_STATUS_SUCCEEDED:
            raise job_ended(job_id, STATUS_NAMES[job.status], job.error)
        if not images.returned(done.outputs):
            raise withheld(job_id)
        finished_at = time.perf_counter()
        now = time.time()
        body = images.images_response(
            job, done.outputs, asked, lambda i: self.job_routes.link(request, job.job_id, i, now)
        )
        response = web.json_response(body)
        # What the gateway took, and what answering took here (devtools show it).
        spent = (("submit", submitted_at - began), ("job", finished_at - submitted_at))
        answer = time.perf_counter() - finished_at
        response.headers["Server-Timing"] = ", ".join(
            f"{name};dur={1000 * s:.2f}" for name, s in (*spent, ("answer", answer))
        )
        return response

    async def _stream(
        self, request: web.Request, job_id: str, key: str, stream: str, wait_s: float
    ) -> web.StreamResponse:
        """Server-sent events in OpenAI's shapes (``image_generation.*``, or
        ``image_edit.*`` for an edit): a partial image per preview the sampler
        sends, then the image; or an ``error`` event naming the job."""
        response = await open_events(request)
        outputs, partials, job = Outputs(), 0, pb.Job(job_id=job_id)
        try:
            async for event in self.gateway.events(job_id, key, wait_s):
                if event.WhichOneof("event") == "preview":
                    await send_event(response, images.partial_event(event.preview, partials, job, stream))
                    partials += 1
                done = outputs.add(event)
                if done is None:
                    continue
                job = done.job
                if job.status != pb.JOB_STATUS_SUCCEEDED:
                    raise job_ended(job_id, STATUS_NAMES[job.status], job.error)
                if not images.returned(done.outputs):
                    raise withheld(job_id)
                for _, output in images.returned(done.outputs):
                    await send_event(response, images.completed_event(job, output, stream))
                break
        except HttpError as exc:
            await send_error_event(response, exc.after_submit(job_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                error = still_running(job_id, self.job_routes.job_url(request, job_id), wait_s)
            else:
                error = from_rpc(exc).after_submit(job_id)
            await send_error_event(response, error)
        await response.write_eof()
        return response

    async def moderations(self, request: web.Request) -> web.Response:
        """Texts and images checked as a submit's would be (``moderations``)."""
        # Each image's base64 decoded: in a thread, as the body was parsed.
        asked = await asyncio.to_thread(moderations.moderation, await json_body(request), self.moderation_limits)
        try:
            found = await self.gateway.stub.Moderate(asked.request, metadata=metadata_of(request), timeout=60)
        except grpc.aio.AioRpcError as exc:
            error = from_rpc(exc)
            if error.param is not None:  # the gateway's field, as the caller named it
                error.param = moderations.param_of(error.param, asked)
            raise error from None
        return web.json_response(moderations.response(found.results, asked))

    async def models(self, request: web.Request) -> web.Response:
        found = await self.gateway.stub.ListModels(pb.ListModelsRequest(), metadata=metadata_of(request), timeout=30)
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

    async def fleet_view(self, request: web.Request) -> web.Response:
        """The fleet's workers and queue (for an admin key), and the caller's usage."""
        stats = await self.gateway.stub.GetStats(pb.GetStatsRequest(), metadata=metadata_of(request), timeout=30)
        return web.json_response(fleet.fleet(stats))

    async def file(self, request: web.Request) -> web.Response:
        return await files.serve(request, self.signer, self.repo)
