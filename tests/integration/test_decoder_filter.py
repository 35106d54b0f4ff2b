"""The decoder service's image filter, over a stand-in classifier: the outputs of
requests that a batch decodes together are scored in one classifier call, each
job's outputs are sent as its policy has them (a blocked one: one last chunk, no
data, every chunk with its score and verdict), and the filter fails closed: a
decoder without one, or whose classifier fails, fails the jobs to be checked (to
be retried elsewhere) and serves the others."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from services.config.workers import DecoderSettings
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2
from services.safety.image_filter import NO_FILTER, ImageFilter
from tests.helpers import env_of
from vae_worker.decode_batches import DecodeBatcher
from vae_worker.output_checks import OutputChecks
from vae_worker.service import VaeDecoderServicer, batcher_for

pytestmark = [pytest.mark.integration, pytest.mark.quick]


class Fixed:
    """A classifier that gives every image one score, counts its calls, and may fail."""

    name = "fixed"

    def __init__(self, score: float, *, fails: bool = False) -> None:
        self.score, self.fails = score, fails
        self.calls: list[int] = []
        self.threads: set[str] = set()

    def scores(self, images: Sequence[np.ndarray]) -> list[float]:
        self.calls.append(len(images))
        self.threads.add(threading.current_thread().name)
        if self.fails:
            raise RuntimeError("the classifier broke")
        return [self.score] * len(images)


def batcher(models_dir: Path) -> DecodeBatcher:
    settings = DecoderSettings.from_env(env_of(decoder_port=0, batch_wait_ms=50))
    engine = VaeDecoderEngine.from_settings(settings.decode, ModelRegistry.load(), models_dir, torch.device("cpu"))
    return batcher_for(settings, engine)


def request(*policies: str, seed: int = 0) -> vae_decoder_pb2.DecodeRequest:
    """One request of a job per policy, one 64x64 image each."""
    z = torch.randn(len(policies), 4, 8, 8, generator=torch.Generator().manual_seed(seed))
    return vae_decoder_pb2.DecodeRequest(
        model="tiny",
        latents=z.numpy().astype("<f4").tobytes(),
        shape=list(z.shape),
        dtype="float32",
        jobs=[
            vae_decoder_pb2.DecodeJob(job_id=f"j{i}", images=1, mime_type="image/png", output_policy=policy)
            for i, policy in enumerate(policies)
        ],
    )


Chunks = dict[int, list[vae_decoder_pb2.DecodeChunk]]


async def chunks(servicer: VaeDecoderServicer, req: vae_decoder_pb2.DecodeRequest) -> Chunks:
    """Each job's chunks, in order."""
    out: Chunks = {}
    async for chunk in servicer.Decode(req, None):  # type: ignore[arg-type]
        out.setdefault(chunk.job, []).append(chunk)
    return out


async def test_a_batchs_outputs_are_scored_in_one_call_off_the_event_loop_and_sent_by_policy(models_dir: Path) -> None:
    classifier = Fixed(0.9)
    servicer = VaeDecoderServicer(batcher(models_dir), OutputChecks(ImageFilter(classifier, 0.8)))
    # Two samplers' requests within the batch's wait: one VAE call, one classifier call.
    first, second = await asyncio.gather(
        chunks(servicer, request("flag", "blur", "", seed=1)), chunks(servicer, request("block", seed=2))
    )
    assert servicer.batcher.batches == 1
    assert classifier.calls == [3]  # the three checked outputs of both requests
    assert classifier.threads == {"image-filter_0"}
    assert all(c.verdict == "flagged" and c.nsfw_score == pytest.approx(0.9) for c in first[0])
    assert all(c.verdict == "blurred" for c in first[1])
    assert all(not c.HasField("nsfw_score") and c.verdict == "" for c in first[2])
    [blocked] = second[0]
    assert blocked.last and blocked.data == b"" and blocked.verdict == "blocked"
    assert (blocked.width, blocked.height) == (64, 64)


async def test_a_decoder_without_a_filter_fails_the_jobs_to_be_checked_and_serves_the_rest(models_dir: Path) -> None:
    servicer = VaeDecoderServicer(batcher(models_dir))  # the filter off here
    got = await chunks(servicer, request("flag", ""))
    [refused] = got[0]
    assert refused.error == NO_FILTER and refused.last and not refused.data
    assert got[1][-1].last and got[1][0].data and not got[1][0].HasField("nsfw_score")


async def test_a_classifier_that_fails_fails_the_checked_jobs_alone(models_dir: Path) -> None:
    classifier = Fixed(0.1, fails=True)
    servicer = VaeDecoderServicer(batcher(models_dir), OutputChecks(ImageFilter(classifier, 0.8)))
    got = await chunks(servicer, request("flag", "", "block"))
    for job in (0, 2):
        [refused] = got[job]
        assert "the image filter failed: RuntimeError: the classifier broke" in refused.error
    assert got[1][0].data and not got[1][0].error
