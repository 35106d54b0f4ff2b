"""OpenAI's video routes (``/v1/videos``), over the gateway with the caller's key:
a video job made, listed, read, deleted (cancelled while not yet made), and its
file. The shapes are ``videos``'."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from http_api import videos
from http_api.errors import HttpError, bad_request, not_found, withheld
from http_api.gateway_client import Gateway, default_model
from http_api.wire import fields_of, job_id_of, key_of
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.verdicts import BLOCKED

ENDED = (pb.JOB_STATUS_SUCCEEDED, pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELLED, pb.JOB_STATUS_EXPIRED)
# GET /v1/videos looks for the caller's videos among this many of its latest jobs.
VIDEO_LIST_SCAN_PAGES, VIDEO_LIST_PAGE_SIZE = 10, 200

# The API's submit: the job stored once under the request's idempotency key.
Submit = Callable[[web.Request, pb.SubmitJobRequest, str], Awaitable[pb.SubmitJobResponse]]


class VideoRoutes:
    def __init__(self, gateway: Gateway, submit: Submit) -> None:
        self.gateway, self._submit = gateway, submit

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/videos", self.create_video),
            web.get("/v1/videos", self.list_videos),
            web.get("/v1/videos/{job_id}", self.video),
            web.delete("/v1/videos/{job_id}", self.delete_video),
            web.get("/v1/videos/{job_id}/content", self.video_content),
        ]

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
        submitted = await self._submit(request, videos.create(fields, model), key)
        return web.json_response(videos.video_object(await self.gateway.get(submitted.job_id, key)))

    async def list_videos(self, request: web.Request) -> web.Response:
        """The caller's videos, newest first (``order=asc``: oldest first), among
        its latest ``VIDEO_LIST_SCAN_PAGES * VIDEO_LIST_PAGE_SIZE`` jobs; ``limit``
        (20 unless set, 100 at most) and ``after`` (the previous page's
        ``last_id``), as OpenAI's list."""
        query = request.query
        limit = query.get("limit", "20")
        if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= 100):
            raise bad_request("limit", f"limit {limit[:20]!r} is not a whole number within 1..100")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order", f"order {order[:20]!r} is not asc or desc")
        key, jobs, token = key_of(request), [], ""
        for _ in range(VIDEO_LIST_SCAN_PAGES):
            page = await self.gateway.jobs(key, VIDEO_LIST_PAGE_SIZE, token)
            jobs.extend(page.jobs)
            token = page.next_page_token
            if not token:
                break
        after = query.get("after", "")
        return web.json_response(videos.video_list(jobs, limit=int(limit), after=after, order=order))

    async def video(self, request: web.Request) -> web.Response:
        return web.json_response(videos.video_object(await self._video_job(request)))

    async def delete_video(self, request: web.Request) -> web.Response:
        """OpenAI's delete: a video not yet made is cancelled (``deleted``); one
        already made, or that failed, stays stored (``deleted`` false)."""
        job = await self._video_job(request)
        if job.status in ENDED:
            return web.json_response(videos.deleted(job.job_id, False))
        cancelled = await self.gateway.cancel(job.job_id, key_of(request))
        # Cancelled, or stopping at its next step; or it ended first, its video made.
        stopped = cancelled.status == pb.JOB_STATUS_CANCELLED or cancelled.status not in ENDED
        return web.json_response(videos.deleted(job.job_id, stopped))

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
        if job.images[0].verdict == BLOCKED:
            raise withheld(job.job_id, "video")
        return web.Response(body=job.images[0].data, content_type=job.images[0].mime_type)

    async def _video_job(self, request: web.Request) -> pb.Job:
        job = await self.gateway.get(job_id_of(request), key_of(request))
        if not videos.is_video(job):
            raise not_found("video")
        return job
