"""The HTTP API's routes: each turns a request into calls to the gateway (with the
caller's key), and their answers into OpenAI's shapes (``images``, ``videos``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from http_api import fleet, images, videos
from http_api.errors import HttpError, bad_request, from_rpc
from http_api.gateway_client import Gateway, Outputs, default_model
from http_api.signed_urls import UrlSigner
from http_api.wire import fields_of, key_of, metadata_of, open_events, send_error_event, send_event
from services.config.http import HttpSettings
from services.db.repository import Repository
from services.errors import StoreError
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

# The page (no build step, nothing from elsewhere): read once.
PAGE = (Path(__file__).with_name("page.html")).read_bytes()
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
            web.get("/", self.page),
            web.post("/v1/images/generations", self.generations),
            web.post("/v1/images/edits", self.edits),
            web.get("/v1/models", self.models),
            web.get("/v1/jobs", self.jobs),
            web.get("/v1/jobs/{job_id}", self.job),
            web.get("/v1/jobs/{job_id}/events", self.job_events),
            web.get("/v1/fleet", self.fleet_view),
            web.get("/v1/files/{job_id}/{index}", self.file),
            web.post("/v1/videos", self.create_video),
            web.get("/v1/videos/{job_id}", self.video),
            web.get("/v1/videos/{job_id}/content", self.video_content),
        ]

    async def page(self, request: web.Request) -> web.Response:
        """The page: a prompt box and a live view of the fleet, over this same API."""
        return web.Response(body=PAGE, content_type="text/html", headers={"Cache-Control": "no-cache"})

    async def generations(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad_request("body", "the body is not JSON") from None
        submit, asked = images.generation(body)
        return await self._run(request, submit, asked, "image")

    async def edits(self, request: web.Request) -> web.StreamResponse:
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
    ) -> web.StreamResponse:
        key = key_of(request)
        if not submit.model:
            submit.model = default_model(await self.gateway.models(key), kind)
        began = time.perf_counter()
        submitted = await self.gateway.submit(submit, key)
        submitted_at = time.perf_counter()
        left_running = web.json_response(
            self._job_json(request, submitted.job_id, STATUS_NAMES[submitted.status]), status=202
        )
        if "respond-async" in request.headers.get("Prefer", ""):
            return left_running
        if asked.stream:
            return await self._stream(request, submitted.job_id, key)
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
        finished_at = time.perf_counter()
        now = time.time()
        body = images.images_response(job, done.outputs, asked, lambda i: self._link(request, job.job_id, i, now))
        response = web.json_response(body)
        # What the gateway took, and what answering took here (devtools show it).
        spent = (("submit", submitted_at - began), ("job", finished_at - submitted_at))
        answer = time.perf_counter() - finished_at
        response.headers["Server-Timing"] = ", ".join(
            f"{name};dur={1000 * s:.2f}" for name, s in (*spent, ("answer", answer))
        )
        return response

    async def _stream(self, request: web.Request, job_id: str, key: str) -> web.StreamResponse:
        """Server-sent events in OpenAI's shapes: a partial image per preview the
        sampler sends, then the image (or an error event)."""
        response = await open_events(request)
        outputs, partials, job = Outputs(), 0, pb.Job(job_id=job_id)
        try:
            async for event in self.gateway.events(job_id, key, self.settings.wait_s):
                if event.WhichOneof("event") == "preview":
                    await send_event(response, images.partial_event(event.preview, partials, job))
                    partials += 1
                done = outputs.add(event)
                if done is None:
                    continue
                job = done.job
                if job.status != pb.JOB_STATUS_SUCCEEDED:
                    raise HttpError(
                        500, f"job {job_id} ended {STATUS_NAMES[job.status]}: {job.error}", kind="server_error"
                    )
                for output in done.outputs:
                    await send_event(response, images.completed_event(job, output))
                break
        except HttpError as exc:
            await send_error_event(response, exc)
        except grpc.aio.AioRpcError as exc:
            await send_error_event(response, from_rpc(exc))
        await response.write_eof()
        return response

    async def create_video(self, request: web.Request) -> web.Response:
        """A video job, answered at once with OpenAI's ``Video`` (``queued``)."""
        fields = await fields_of(request)
        if "input_reference" in fields:
            raise bad_request("input_reference", "a video from an input image is not served yet")
        key = key_of(request)
        models = await self.gateway.models(key)
        name = str(fields.get("model") or "") or default_model(models, "video")
        model = next((m for m in models.models if m.name == name), None)
        if model is None:
            raise bad_request("model", f"unknown model {name!r}")
        if model.capability != "video":
            raise bad_request("model", f"{name} makes {model.capability}, not video")
        submitted = await self.gateway.submit(videos.create(fields, model), key)
        return web.json_response(videos.video_object(await self.gateway.get(submitted.job_id, key)))

    async def video(self, request: web.Request) -> web.Response:
        return web.json_response(videos.video_object(await self._video_job(request)))

    async def video_content(self, request: web.Request) -> web.Response:
        variant = request.query.get("variant", "video")
        if variant != "video":
            raise bad_request("variant", f"variant {variant!r} is not served: only the video")
        job = await self._video_job(request)
        if job.status != pb.JOB_STATUS_SUCCEEDED or not job.images:
            status = videos.video_object(job)["status"]
            raise HttpError(
                404, f"the video is {status}, not completed", kind="invalid_request_error", code="not_ready"
            )
        return web.Response(body=job.images[0].data, content_type=job.images[0].mime_type)

    async def _video_job(self, request: web.Request) -> pb.Job:
        job = await self.gateway.get(request.match_info["job_id"], key_of(request))
        if job.task != "text_to_video":
            raise HttpError(404, "no such video", kind="invalid_request_error", code="not_found")
        return job

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

    async def jobs(self, request: web.Request) -> web.Response:
        """The caller's most recent jobs (``limit``, 20 unless set), newest first."""
        limit = request.query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 200:
            raise bad_request("limit", f"limit {limit!r} is not a whole number within 1..200")
        page = await self.gateway.stub.ListJobs(
            pb.ListJobsRequest(page_size=int(limit)), metadata=metadata_of(request), timeout=30
        )
        data = [fleet.job_summary(j, STATUS_NAMES[j.status]) for j in page.jobs]
        return web.json_response({"object": "list", "data": data})

    async def fleet_view(self, request: web.Request) -> web.Response:
        """The fleet's workers and queue (for an admin key), and the caller's usage."""
        stats = await self.gateway.stub.GetStats(pb.GetStatsRequest(), metadata=metadata_of(request), timeout=30)
        return web.json_response(fleet.fleet(stats))

    async def job(self, request: web.Request) -> web.Response:
        job = await self.gateway.get(request.match_info["job_id"], key_of(request))
        return web.json_response(self._job_body(request, job))

    def _job_body(self, request: web.Request, job: pb.Job) -> dict[str, Any]:
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
            # A stream's terminal event carries no images (they came before it in chunks).
            outputs = len(job.images) or job.num_images
            body["data"] = [{"url": self._link(request, job.job_id, i, now)} for i in range(outputs)]
        return body

    async def job_events(self, request: web.Request) -> web.StreamResponse:
        """A job followed as server-sent events: ``darkroom.job.status`` and
        ``darkroom.job.progress`` as they happen, then ``darkroom.job.done`` with
        what ``GET /v1/jobs/{id}`` answers at the end. Every step the sampler
        reports arrives, where polling would see only some."""
        job_id, key = request.match_info["job_id"], key_of(request)
        events = self.gateway.events(job_id, key, self.settings.wait_s)
        try:
            first = await anext(aiter(events), None)  # an unknown job is a 404, before the stream starts
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc) from None
        response = await open_events(request)

        async def rest() -> AsyncIterator[pb.JobEvent]:
            if first is not None:
                yield first
            async for event in events:
                yield event

        try:
            async for event in rest():
                kind = event.WhichOneof("event")
                if kind == "status":
                    await send_event(response, {"type": "darkroom.job.status", "status": STATUS_NAMES[event.status]})
                elif kind == "progress":
                    step, total = event.progress.step, event.progress.total
                    await send_event(response, {"type": "darkroom.job.progress", "step": step, "total": total})
                elif kind == "terminal":
                    body = self._job_body(request, event.terminal)
                    await send_event(response, {"type": "darkroom.job.done", "job": body})
                    break
        except grpc.aio.AioRpcError as exc:
            await send_error_event(response, from_rpc(exc))
        await response.write_eof()
        return response

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
