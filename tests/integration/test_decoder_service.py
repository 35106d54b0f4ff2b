"""The decoder service over real gRPC, in-process on port 0, with the tiny model's
real VAE: batching of concurrent requests, the output formats, tiled decode of
large images, and the output check."""

from __future__ import annotations

import asyncio
import io
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from services.config.workers import DecoderSettings
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from tests.helpers import env_of, wait_for
from vae_worker.decode_batches import DecodeBatcher
from vae_worker.service import batcher_for, create_server

pytestmark = [pytest.mark.integration, pytest.mark.quick]

CPU = torch.device("cpu")


@dataclass
class Decoder:
    stub: vae_decoder_pb2_grpc.VaeDecoderStub
    batcher: DecodeBatcher


@pytest.fixture
def data_dir(tmp_path: Path, models_dir: Path) -> Path:
    """A data directory whose models are the session's built tiny model."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "models").symlink_to(models_dir, target_is_directory=True)
    return tmp_path / "data"


@asynccontextmanager
async def decoder_service(data_dir: Path, registry: Path | None = None, **overrides: Any) -> AsyncIterator[Decoder]:
    settings = DecoderSettings.from_env(env_of(decoder_port=0, **overrides))
    engine = VaeDecoderEngine.from_settings(settings.decode, ModelRegistry.load(registry), data_dir / "models", CPU)
    batcher = batcher_for(settings, engine)
    server = create_server(settings, batcher)
    await server.grpc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield Decoder(vae_decoder_pb2_grpc.VaeDecoderStub(ch), batcher)
    finally:
        await server.grpc.stop(0)


def latents(n: int, height: int = 8, width: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, height, width, generator=torch.Generator().manual_seed(seed))


def request(*jobs: torch.Tensor, mime_type: str = "image/png") -> vae_decoder_pb2.DecodeRequest:
    """One request for jobs of these latents each (a sampler's batch)."""
    array = torch.cat(jobs).numpy().astype("<f4")
    return vae_decoder_pb2.DecodeRequest(
        model="tiny",
        latents=array.tobytes(),
        shape=list(array.shape),
        dtype="float32",
        jobs=[
            vae_decoder_pb2.DecodeJob(job_id=f"j{i}", images=len(z), mime_type=mime_type) for i, z in enumerate(jobs)
        ],
    )


class Refused(Exception):
    """The decoder said it could not make a job's images."""


@dataclass
class Decoded:
    data: bytes
    mime_type: str
    width: int
    height: int

    def pixels(self) -> np.ndarray:
        with Image.open(io.BytesIO(self.data)) as img:
            return np.asarray(img.convert("RGB"))


async def decode_jobs(decoder: Decoder, req: vae_decoder_pb2.DecodeRequest) -> list[list[Decoded] | Refused]:
    """Each job's images, or what the decoder said instead."""
    parts: dict[tuple[int, int], bytearray] = {}
    images: dict[tuple[int, int], Decoded] = {}
    refused: dict[int, Refused] = {}
    async for chunk in decoder.stub.Decode(req):
        if chunk.error:
            assert chunk.job not in refused and not any(j == chunk.job for j, _ in parts)
            refused[chunk.job] = Refused(chunk.error)
            continue
        data = parts.setdefault((chunk.job, chunk.index), bytearray())
        assert chunk.offset == len(data), "chunks out of order"
        data += chunk.data
        if chunk.last:
            images[(chunk.job, chunk.index)] = Decoded(bytes(data), chunk.mime_type, chunk.width, chunk.height)
    out: list[list[Decoded] | Refused] = []
    for n, job in enumerate(req.jobs):
        if n in refused:
            out.append(refused[n])
        else:
            assert sorted(i for j, i in images if j == n) == list(range(job.images))
            out.append([images[(n, i)] for i in range(job.images)])
    return out


async def decode(decoder: Decoder, req: vae_decoder_pb2.DecodeRequest) -> list[Decoded]:
    """The images of a request of one job; raises Refused if it has none."""
    [got] = await decode_jobs(decoder, req)
    if isinstance(got, Refused):
        raise got
    return got


def solo(models_dir: Path, z: torch.Tensor) -> list[np.ndarray]:
    """What the tiny VAE makes of ``z`` decoded alone, outside the service."""
    return VaeDecoderEngine(ModelRegistry.load(), models_dir, CPU).decode("tiny", z)


async def test_concurrent_requests_of_one_shape_run_as_one_batch_each_getting_its_own_images(
    data_dir, models_dir
) -> None:
    # A long wait and room for exactly both: the batch runs when the second arrives.
    async with decoder_service(data_dir, decode_batch_wait_ms=10_000, decode_max_batch=3) as decoder:
        one, two = latents(1, seed=1), latents(2, seed=2)
        got_one, got_two = await asyncio.gather(decode(decoder, request(one)), decode(decoder, request(two)))
        load = decoder.batcher.telemetry()
    assert (load["decoded_batches"], load["decoded_images"], load["largest_batch"]) == (1, 3, 3)
    assert load["queued_images"] == 0 and load["seconds_per_megapixel"] > 0
    for got, z in ((got_one, one), (got_two, two)):
        assert len(got) == len(z)
        for image, alone in zip(got, solo(models_dir, z), strict=True):
            assert (image.width, image.height) == (64, 64)
            # Exactly the pixels decoded alone (on a CPU; a GPU fuses the batch).
            assert np.array_equal(image.pixels(), alone)


async def test_the_load_and_each_batch_are_prometheus_metrics(data_dir) -> None:
    from prometheus_client import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    async def load_is(images: float) -> None:
        def held() -> float:
            return sample("darkroom_decoder_queued_images")

        await asyncio.to_thread(wait_for, held, lambda n: n == images, timeout=10, what=f"{images} images held")

    batches, decoded = (
        sample("darkroom_decode_batch_images_count", model="tiny"),
        sample("darkroom_decode_batch_images_sum", model="tiny"),
    )
    timed = sample("darkroom_decode_seconds_count", model="tiny")
    async with decoder_service(data_dir, decode_batch_wait_ms=10_000, decode_max_batch=3) as decoder:
        first = asyncio.ensure_future(decode(decoder, request(latents(1))))
        await load_is(1)  # it waits for company
        assert sample("darkroom_decoder_queued_megapixels") == pytest.approx(64 * 64 / 1e6)
        await decode(decoder, request(latents(2)))  # fills the batch, which runs
        await first
        await load_is(0)
    assert sample("darkroom_decoder_queued_megapixels") == 0
    assert sample("darkroom_decode_batch_images_count", model="tiny") == batches + 1
    assert sample("darkroom_decode_batch_images_sum", model="tiny") == decoded + 3
    assert sample("darkroom_decode_seconds_count", model="tiny") == timed + 1


async def test_requests_of_different_shapes_run_apart(data_dir) -> None:
    async with decoder_service(data_dir, decode_batch_wait_ms=200, decode_max_batch=8) as decoder:
        square, wide = await asyncio.gather(
            decode(decoder, request(latents(1))), decode(decoder, request(latents(1, width=12)))
        )
        load = decoder.batcher.telemetry()
    assert (square[0].width, square[0].height) == (64, 64)
    assert (wide[0].width, wide[0].height) == (96, 64)
    assert (load["decoded_batches"], load["largest_batch"]) == (2, 1)


@pytest.mark.parametrize(
    ("mime_type", "magic", "pil_format"),
    [
        ("image/png", b"\x89PNG\r\n\x1a\n", "PNG"),
        ("image/jpeg", b"\xff\xd8\xff", "JPEG"),
        ("image/webp", b"RIFF", "WEBP"),
        ("", b"\x89PNG\r\n\x1a\n", "PNG"),
    ],
)
async def test_each_format_is_encoded_as_asked(data_dir, mime_type: str, magic: bytes, pil_format: str) -> None:
    async with decoder_service(data_dir) as decoder:
        images = await decode(decoder, request(latents(2, width=12), mime_type=mime_type))
    for image in images:
        assert image.data.startswith(magic)
        assert image.mime_type == (mime_type or "image/png")
        with Image.open(io.BytesIO(image.data)) as img:
            img.load()
            assert (img.format, img.size) == (pil_format, (96, 64))


async def test_an_unknown_format_is_refused_by_name(data_dir) -> None:
    async with decoder_service(data_dir) as decoder:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode(decoder, request(latents(1), mime_type="image/gif"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mime_type" in (err.value.details() or "")


async def test_a_large_image_decodes_in_tiles_close_to_whole(data_dir, models_dir) -> None:
    # The tiny VAE's tiles are 128 px: a 256 px image is three by three overlapping tiles.
    async with decoder_service(data_dir, decode_tile_above_pixels=128 * 128) as decoder:
        small = await decode(decoder, request(latents(1)))
        assert decoder.batcher.telemetry()["tiled_images"] == 0
        z = latents(1, height=32, width=32, seed=3)
        [large] = await decode(decoder, request(z))
        assert decoder.batcher.telemetry()["tiled_images"] == 1
    assert (small[0].width, small[0].height) == (64, 64)
    assert (large.width, large.height) == (256, 256)
    [whole] = solo(models_dir, z)
    tiled = large.pixels().astype(float)
    # Tiles see less context at their edges, which the blending mostly hides:
    # close on average, while an image of other latents is far.
    [other] = solo(models_dir, latents(1, height=32, width=32, seed=4))
    assert np.abs(tiled - whole).mean() < 8
    assert np.abs(tiled - whole).mean() < np.abs(other.astype(float) - whole).mean() / 3


async def test_nan_latents_fail_their_job_alone_in_their_batch(data_dir) -> None:
    bad = latents(1)
    bad[0, 0, 0, 0] = float("nan")
    async with decoder_service(data_dir, decode_batch_wait_ms=10_000, decode_max_batch=2) as decoder:
        good, failed = await asyncio.gather(
            decode(decoder, request(latents(1))), decode(decoder, request(bad)), return_exceptions=True
        )
        assert decoder.batcher.telemetry()["decoded_batches"] == 1
    assert isinstance(good, list) and (good[0].width, good[0].height) == (64, 64)
    assert isinstance(failed, Refused) and "NaN" in str(failed)


async def test_a_request_of_several_jobs_gets_each_job_its_images_and_a_bad_one_fails_alone(
    data_dir, models_dir
) -> None:
    one, bad, two = latents(1, seed=1), latents(2, seed=2), latents(2, seed=3)
    bad[1, 0, 0, 0] = float("nan")
    async with decoder_service(data_dir) as decoder:
        got_one, got_bad, got_two = await decode_jobs(decoder, request(one, bad, two))
        assert decoder.batcher.telemetry()["decoded_batches"] == 1  # the three jobs in one VAE call
    assert isinstance(got_bad, Refused) and "image 1" in str(got_bad)
    for got, z in ((got_one, one), (got_two, two)):
        assert isinstance(got, list) and len(got) == len(z)
        for image, alone in zip(got, solo(models_dir, z), strict=True):
            assert np.array_equal(image.pixels(), alone)


async def test_jobs_that_do_not_account_for_the_latents_are_refused_by_name(data_dir) -> None:
    req = request(latents(2))
    req.jobs[0].images = 1
    async with decoder_service(data_dir) as decoder:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode_jobs(decoder, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "jobs" in (err.value.details() or "")


def flat_vae_registry(models_dir: Path, where: Path) -> Path:
    """A registry whose "tiny" has a VAE with a zeroed output layer: every image it
    decodes is one flat grey."""
    broken = where / "tiny-flat-vae"
    shutil.copytree(models_dir / "tiny", broken)
    [weights] = (broken / "vae").glob("*.safetensors")
    tensors = load_file(weights)
    for name in ("decoder.conv_out.weight", "decoder.conv_out.bias"):
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, weights)
    registry = where / "flat.toml"
    registry.write_text(f'[models.tiny]\nsource = "{broken}"\nfamily = "tiny"\ndtype = "float32"\n')
    return registry


async def test_degenerate_pixels_fail_their_job(data_dir, models_dir, tmp_path: Path) -> None:
    async with decoder_service(data_dir, flat_vae_registry(models_dir, tmp_path)) as decoder:
        with pytest.raises(Refused) as err:
            await decode(decoder, request(latents(1)))
    assert "degenerate" in str(err.value)


async def test_encode_prompt_answers_a_served_models_conditioning_and_refuses_a_model_by_name(
    data_dir: Path, tmp_path: Path
) -> None:
    """A model whose text encoders the decoder serves: its conditioning as safetensors
    bytes, the same prompt again from the cache; an unknown model, or one whose encoders
    are not served, is INVALID_ARGUMENT naming ``model``."""
    from services.models.prompt_encoding import from_bytes

    registry = tmp_path / "registry.toml"
    flux = '[models.flux]\nsource = "builtin:tiny-flux"\nfamily = "flux"\ndtype = "float32"\nsize_step = 16\n'
    registry.write_text(flux + 'text_encoders = "service"\n[models.tiny]\nsource = "builtin:tiny"\nfamily = "tiny"\n')
    ask = vae_decoder_pb2.EncodePromptRequest(model="flux", prompt="a lighthouse", width=64, height=64, job_id="j")
    async with decoder_service(data_dir, registry) as decoder:
        first = await decoder.stub.EncodePrompt(ask)
        again = await decoder.stub.EncodePrompt(ask)
        for model in ("nope", "tiny"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await decoder.stub.EncodePrompt(vae_decoder_pb2.EncodePromptRequest(model=model, prompt="x"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "model" in (err.value.details() or "")
    tensors = from_bytes(first.conditioning)
    assert set(tensors) == {"embeds", "pooled"} and tensors["embeds"].dtype == torch.float32
    assert (first.cached, again.cached, again.conditioning) == (False, True, first.conditioning)
