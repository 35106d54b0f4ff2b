"""Every call a server built by ``build_server`` handles is counted by method and
final status code, and timed: unary and server-streaming, ending normally, with
``context.abort``, with a Darkroom error mapped to a status, with an unexpected
exception, or with the client going away. Served in-process on port 0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from services.errors import NotFound
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.rpc.server import build_server
from services.rpc.status import stream_errors, unary_errors
from tests.helpers import channel_to, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.quick]

CANCEL = "/darkroom.internal.v1.Sampler/CancelJob"
WATCH = "/darkroom.v1.ImageGeneration/StreamJob"


class Scripted(sampler_pb2_grpc.SamplerServicer):
    """A Sampler whose calls end the way their job id says."""

    @unary_errors
    async def CancelJob(
        self, request: sampler_pb2.SamplerCancelRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.SamplerCancelResponse:
        if request.job_id == "abort":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
        if request.job_id == "missing":
            raise NotFound("no such job")  # mapped by unary_errors: abort_with_status
        if request.job_id == "set-code":
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
        return sampler_pb2.SamplerCancelResponse(was_running=True)


class ScriptedStreams(image_generation_pb2_grpc.ImageGenerationServicer):
    """A StreamJob whose streams end the way their job id says."""

    async def StreamJob(  # no decorator: an exception reaches grpc as it is
        self, request: pb.StreamJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JobEvent]:
        yield pb.JobEvent(job_id=request.job_id, status=pb.JOB_STATUS_RUNNING)
        if request.job_id == "abort":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gone")
        if request.job_id == "boom":
            raise RuntimeError("a bug")
        if request.job_id == "forever":
            await asyncio.sleep(3600)
        yield pb.JobEvent(job_id=request.job_id, status=pb.JOB_STATUS_SUCCEEDED)


class Mapped(ScriptedStreams):
    @stream_errors
    async def StreamJob(
        self, request: pb.StreamJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JobEvent]:
        yield pb.JobEvent(job_id=request.job_id, status=pb.JOB_STATUS_RUNNING)
        raise NotFound("the job moved on")


def count(method: str, code: str) -> float:
    return REGISTRY.get_sample_value("darkroom_rpc_requests_total", {"method": method, "code": code}) or 0.0


def timed(method: str) -> float:
    return REGISTRY.get_sample_value("darkroom_rpc_duration_seconds_count", {"method": method}) or 0.0


async def serving(
    servicer: sampler_pb2_grpc.SamplerServicer, streams: image_generation_pb2_grpc.ImageGenerationServicer
) -> AsyncIterator[tuple[sampler_pb2_grpc.SamplerStub, image_generation_pb2_grpc.ImageGenerationStub]]:
    server = build_server(
        [
            (lambda s: sampler_pb2_grpc.add_SamplerServicer_to_server(servicer, s), "darkroom.internal.v1.Sampler"),
            (
                lambda s: image_generation_pb2_grpc.add_ImageGenerationServicer_to_server(streams, s),
                "darkroom.v1.ImageGeneration",
            ),
        ],
        "127.0.0.1",
        0,
    )
    async for ch in channel_to(server):
        yield sampler_pb2_grpc.SamplerStub(ch), image_generation_pb2_grpc.ImageGenerationStub(ch)


@pytest.fixture
async def sampler() -> AsyncIterator[sampler_pb2_grpc.SamplerStub]:
    async for stub, _ in serving(Scripted(), ScriptedStreams()):
        yield stub


@pytest.fixture
async def streams() -> AsyncIterator[image_generation_pb2_grpc.ImageGenerationStub]:
    async for _, stub in serving(Scripted(), ScriptedStreams()):
        yield stub


async def watch(stub: image_generation_pb2_grpc.ImageGenerationStub, job_id: str) -> grpc.StatusCode:
    try:
        async for _ in stub.StreamJob(pb.StreamJobRequest(job_id=job_id)):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def cancel(stub: sampler_pb2_grpc.SamplerStub, job_id: str) -> grpc.StatusCode:
    try:
        await stub.CancelJob(sampler_pb2.SamplerCancelRequest(job_id=job_id))
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("job_id", "code"),
    [
        ("fine", "OK"),
        ("abort", "INVALID_ARGUMENT"),
        ("missing", "NOT_FOUND"),
        ("set-code", "FAILED_PRECONDITION"),
    ],
)
async def test_unary_calls_are_counted_by_the_code_the_client_gets(sampler, job_id: str, code: str) -> None:
    before, before_timed = count(CANCEL, code), timed(CANCEL)
    assert (await cancel(sampler, job_id)).name == code
    # An abort sends the status before the server's handler has unwound through the
    # interceptor that counts it (a CI run under load saw the client first): poll.
    await asyncio.to_thread(
        wait_for,
        lambda: (count(CANCEL, code), timed(CANCEL)),
        lambda counted: counted == (before + 1, before_timed + 1),
        timeout=10,
        what=f"the {code} call counted and timed",
    )


@pytest.mark.parametrize(
    ("job_id", "code"),
    [
        ("fine", "OK"),
        ("abort", "UNAVAILABLE"),  # context.abort after a response went out
        ("boom", "UNKNOWN"),  # an exception no decorator mapped
    ],
)
async def test_streams_are_counted_when_they_end(streams, job_id: str, code: str) -> None:
    before = count(WATCH, code)
    assert (await watch(streams, job_id)).name == code
    # The status can reach the client before the server's handler has unwound (an
    # abort sends it first): poll, with a deadline, as for a cancel below.
    await asyncio.to_thread(
        wait_for, lambda: count(WATCH, code), lambda n: n == before + 1, timeout=10, what=f"the {code} stream counted"
    )


async def test_a_stream_ended_by_a_mapped_error_is_counted_with_its_status() -> None:
    before = count(WATCH, "NOT_FOUND")
    async for _, stub in serving(Scripted(), Mapped()):
        assert await watch(stub, "any") == grpc.StatusCode.NOT_FOUND
    assert count(WATCH, "NOT_FOUND") == before + 1


async def test_a_stream_the_client_leaves_is_counted_cancelled(streams) -> None:
    before = count(WATCH, "CANCELLED")
    call = streams.StreamJob(pb.StreamJobRequest(job_id="forever"))
    await call.read()  # the stream is open on the server
    call.cancel()
    # The server learns of it after the client: poll, with a deadline.
    await asyncio.to_thread(
        wait_for, lambda: count(WATCH, "CANCELLED"), lambda n: n == before + 1, timeout=10, what="the cancel"
    )


class RefuseAll(grpc.aio.ServerInterceptor):
    """Refuses every call before its method is looked up, as an authenticating
    interceptor does."""

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no key")

        return grpc.unary_unary_rpc_method_handler(refuse)


async def bare_server(*interceptors: grpc.aio.ServerInterceptor) -> AsyncIterator[grpc.aio.Channel]:
    """A server with health checking and reflection only."""
    async for ch in channel_to(build_server([], "127.0.0.1", 0, interceptors)):
        yield ch


async def test_health_checks_are_counted_too() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    check = "/grpc.health.v1.Health/Check"
    before = count(check, "NOT_FOUND")
    async for ch in bare_server():
        # The health servicer aborts with NOT_FOUND for a service it does not know.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert count(check, "NOT_FOUND") == before + 1


async def test_refused_calls_are_counted_and_made_up_names_are_not_labels() -> None:
    from services.rpc.gen.darkroom.v1 import image_generation_pb2  # its descriptor names the public methods

    get_job = f"/{image_generation_pb2.DESCRIPTOR.services_by_name['ImageGeneration'].full_name}/GetJob"
    before, before_other = count(get_job, "UNAUTHENTICATED"), count("other", "UNAUTHENTICATED")
    async for ch in bare_server(RefuseAll()):
        # Refused before the method is looked up: any name is refused.
        for method in (get_job, "/darkroom.v1.ImageGeneration/Made-Up-1234"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary(method)(b"")
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert count(get_job, "UNAUTHENTICATED") == before + 1
    assert count("other", "UNAUTHENTICATED") == before_other + 1
