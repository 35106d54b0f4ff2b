"""The HTTP API's jobs followed (``/v1/jobs``): the caller's jobs listed, one read,
one followed as server-sent events; and the links to a job and to its outputs that
every route's answers carry."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web

from http_api import fleet, images
from http_api.errors import bad_request, from_rpc
from http_api.gateway_client import Gateway
from http_api.signed_urls import UrlSigner
from http_api.wire import job_id_of, key_of, metadata_of, open_events, send_error_event, send_event
from services.config.http import HttpSettings
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

STATUS_NAMES = {value: name.removeprefix("JOB_STATUS_").lower() for name, value in pb.JobStatus.items()}


class JobRoutes:
    def __init__(self, settings: HttpSettings, gateway: Gateway, signer: UrlSigner) -> None:
        self.settings, self.gateway, self.signer = settings, gateway, signer

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/jobs", self.jobs),
            web.get("/v1/jobs/{job_id}", self.job),
            web.get("/v1/jobs/{job_id}/events", self.job_events),
        ]

    async def jobs(self, request: web.Request) -> web.Response:
        """The caller's most recent jobs (``limit``, 20 unless set), newest first."""
        limit = request.query.get("limit", "20")
        if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= 200):
            raise bad_request("limit", f"limit {limit[:20]!r} is not a whole number within 1..200")
        page = await self.gateway.stub.ListJobs(
            pb.ListJobsRequest(page_size=int(limit)), metadata=metadata_of(request), timeout=30
        )
        data = [fleet.job_summary(j, STATUS_NAMES[j.status]) for j in page.jobs]
        return web.json_response({"object": "list", "data": data})

    async def job(self, request: web.Request) -> web.Response:
        job = await self.gateway.get(job_id_of(request), key_of(request))
        return web.json_response(self.job_body(request, job))

    def job_body(self, request: web.Request, job: pb.Job) -> dict[str, Any]:
        """``job`` as ``GET /v1/jobs/{id}`` answers it: its state and, once it
        succeeded, a link to each output returned."""
        body = self.job_json(request, job.job_id, STATUS_NAMES[job.status])
        now = time.time()
        body.update(
            model=job.model,
            created=job.timings.created_time.seconds,
            progress={"step": job.progress.step, "total": job.progress.total},
            error=job.error or None,
            usage=images.usage(job),
        )
        if job.status == pb.JOB_STATUS_SUCCEEDED:
            # A stream's terminal event carries no images (they came before it in chunks);
            # GetJob's do, and those the image filter blocked get no link.
            outputs = [i for i, _ in images.returned(job.images)] if job.images else range(job.num_images)
            body["data"] = [{"url": self.link(request, job.job_id, i, now)} for i in outputs]
            if job.expanded_prompt:  # as the images response says it (images.images_response)
                for entry in body["data"]:
                    entry["revised_prompt"] = job.expanded_prompt
        return body

    async def job_events(self, request: web.Request) -> web.StreamResponse:
        """A job followed as server-sent events: ``darkroom.job.status`` and
        ``darkroom.job.progress`` as they happen, then ``darkroom.job.done`` with
        what ``GET /v1/jobs/{id}`` answers at the end. Every step the sampler
        reports arrives, where polling would see only some."""
        job_id, key = job_id_of(request), key_of(request)
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
                    body = self.job_body(request, event.terminal)
                    await send_event(response, {"type": "darkroom.job.done", "job": body})
                    break
        except grpc.aio.AioRpcError as exc:
            await send_error_event(response, from_rpc(exc))
        await response.write_eof()
        return response

    def job_json(self, request: web.Request, job_id: str, status: str) -> dict[str, Any]:
        """What every answer naming a job holds: its id, status and link."""
        return {"id": job_id, "object": "darkroom.job", "status": status, "url": self.job_url(request, job_id)}

    def job_url(self, request: web.Request, job_id: str) -> str:
        """Where the job is read (``GET /v1/jobs/{id}``)."""
        return f"{self._base(request)}/v1/jobs/{job_id}"

    def link(self, request: web.Request, job_id: str, index: int, now: float) -> str:
        """The signed link to the job's output ``index``, signed at ``now``."""
        return self._base(request) + self.signer.path(job_id, index, now)

    def _base(self, request: web.Request) -> str:
        return self.settings.public_url.rstrip("/") or f"{request.scheme}://{request.host}"
