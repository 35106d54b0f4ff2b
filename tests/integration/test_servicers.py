"""The sampler's and the decoder's gRPC servicers, served in-process on port 0
(``create_server``): their failure paths answer with the right status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from gpu_worker.jobs.tracker import JobTracker, StopReason
from gpu_worker.servicer import create_server as create_sampler_server
from services.config.workers import DecoderSettings, SamplerSettings
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc, vae_decoder_pb2, vae_decoder_pb2_grpc
from tests.helpers import channel_to
from vae_worker.service import batcher_for
from vae_worker.service import create_server as create_decoder_server

pytestmark = [pytest.mark.integration, pytest.mark.quick]


@pytest.fixture
async def sampler() -> AsyncIterator[sampler_pb2_grpc.SamplerStub]:
    async for ch in channel_to(create_sampler_server(SamplerSettings(port=0), JobTracker())):
        yield sampler_pb2_grpc.SamplerStub(ch)


@pytest.fixture
async def decoder(models_dir: Path) -> AsyncIterator[vae_decoder_pb2_grpc.VaeDecoderStub]:
    settings = DecoderSettings(port=0)
    engine = VaeDecoderEngine(ModelRegistry.load(), models_dir, torch.device("cpu"))
    async for ch in channel_to(create_decoder_server(settings, batcher_for(settings, engine))):
        yield vae_decoder_pb2_grpc.VaeDecoderStub(ch)


async def test_cancelling_a_job_the_sampler_does_not_run_says_so(sampler) -> None:
    reply = await sampler.CancelJob(sampler_pb2.SamplerCancelRequest(job_id="nope"))
    assert not reply.was_running


async def suspend(sampler: sampler_pb2_grpc.SamplerStub, job_id: str, attempt: int) -> bool:
    request = sampler_pb2.SamplerSuspendRequest(job_id=job_id, attempt=attempt, reason=f"preempted for {job_id}x")
    return (await sampler.SuspendJob(request)).was_running


async def test_suspend_reaches_only_the_attempt_asked_for_while_it_samples() -> None:
    tracker = JobTracker()
    sampling, sampled = tracker.open("j1", 2), tracker.open("j2", 1)
    sampled.sampled = True
    async for ch in channel_to(create_sampler_server(SamplerSettings(port=0), tracker)):
        sampler = sampler_pb2_grpc.SamplerStub(ch)
        assert not await suspend(sampler, "j1", 1), "an older attempt of it"
        assert not await suspend(sampler, "j2", 1), "its latents are out: nothing left to suspend"
        assert not await suspend(sampler, "nope", 1)
        assert not sampling.stopping.is_set() and not sampled.stopping.is_set()
        assert await suspend(sampler, "j1", 2)
    assert sampling.stopping.is_set() and sampling.stop_reason == StopReason.PREEMPTED
    assert sampling.suspending and not sampling.discards_work
    assert sampling.detail == "preempted for j1x"


async def test_decoder_names_what_is_wrong_with_the_latents(decoder) -> None:
    bad = vae_decoder_pb2.DecodeRequest(
        model="tiny",
        latents=b"\0" * 12,
        shape=[1, 4, 8, 8],
        dtype="float32",
        jobs=[vae_decoder_pb2.DecodeJob(images=1)],
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in decoder.Decode(bad):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "latents" in (err.value.details() or "")


async def test_decoder_refuses_an_unknown_model(decoder) -> None:
    request = vae_decoder_pb2.DecodeRequest(
        model="nope",
        latents=b"\0" * 4 * 256,
        shape=[1, 4, 8, 8],
        dtype="float32",
        jobs=[vae_decoder_pb2.DecodeJob(images=1)],
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in decoder.Decode(request):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown model" in (err.value.details() or "")


async def test_decoder_turns_latents_into_pngs(decoder) -> None:
    request = vae_decoder_pb2.DecodeRequest(
        model="tiny",
        latents=b"\0" * 4 * 512,
        shape=[2, 4, 8, 8],
        dtype="float32",
        jobs=[vae_decoder_pb2.DecodeJob(images=2)],
    )
    chunks = [c async for c in decoder.Decode(request)]
    assert sorted({c.index for c in chunks}) == [0, 1] and {c.job for c in chunks} == {0}
    assert all((c.width, c.height) == (64, 64) for c in chunks if c.last)
