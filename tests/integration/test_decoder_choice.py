"""A sampler's choice of decoder, with real decoder services (``vae_worker.serve``
in-process: gRPC on a free port, registered in a real PostgreSQL, heartbeats on a
real nats-server, seen through a presence view as a sampler sees them): the latents go
to the decoder that will finish them first by its heartbeated load, the next one
is tried when a decoder's output is degenerate, and the sampler decodes locally,
in the job's format, when no decoder is reachable."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import numpy as np
import pytest
import torch
from PIL import Image

from gpu_worker.decoding.decoders import Decoders, DecodeUnavailable
from gpu_worker.decoding.local_decode import LocalDecoder
from services.bus.presence_board import Announcement, BoardOnConnection, PresenceBoard
from services.config.sections import KernelSettings
from services.config.workers import DecoderSettings
from services.db.records import JobRecord
from services.db.states import JobStatus, WorkerKind
from services.db.worker_records import WorkerHeartbeat, WorkerRecord
from services.models.encoding import encode
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.ops.embedded import EmbeddedPostgres
from services.ops.embedded_nats import EmbeddedNats
from services.ops.processes import free_port
from services.presence_view import PresenceView, follow
from services.rpc.gen.darkroom.internal.v1 import vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.server import channel
from tests.conftest import migrated_database
from tests.helpers import env_of
from tests.integration.test_decoder_service import flat_vae_registry
from tests.records import new_job, record
from vae_worker.service import serve

pytestmark = [pytest.mark.integration, pytest.mark.quick]

T = TypeVar("T")
STALE_AFTER_S = 10.0


@pytest.fixture
def data_dir(tmp_path: Path, models_dir: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "models").symlink_to(models_dir, target_is_directory=True)
    return tmp_path / "data"


@pytest.fixture
def database_url(postgres: EmbeddedPostgres) -> str:
    url = migrated_database(postgres)
    return url


@pytest.fixture
async def presence(nats_server: EmbeddedNats) -> AsyncIterator[PresenceView]:
    """The decoders as a sampler's view of the presence bucket has them."""
    nc = await nats.connect(nats_server.url)
    view = PresenceView((WorkerKind.DECODER,))
    stop = asyncio.Event()
    following = asyncio.create_task(follow(view, nc, BoardOnConnection(lambda: nc), stop))
    yield view
    stop.set()
    await following
    await nc.close()


async def until(fetch: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, what: str) -> T:
    """Polls ``fetch`` until ``done``, for at most a minute."""
    last: T | None = None
    try:
        async with asyncio.timeout(60):
            while True:
                last = await fetch()
                if done(last):
                    return last
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}; last: {last}") from None


async def decoders_by_id(presence: PresenceView) -> dict[str, WorkerRecord]:
    return {d.id: d for d in presence.live(WorkerKind.DECODER, stale_after_s=STALE_AFTER_S)}


@dataclass(frozen=True)
class Backends:
    data_dir: Path
    database_url: str
    nats_url: str
    presence: PresenceView


@pytest.fixture
def backends(data_dir: Path, database_url: str, nats_server: EmbeddedNats, presence: PresenceView) -> Backends:
    return Backends(data_dir, database_url, nats_server.url, presence)


@asynccontextmanager
async def decoder_service(backends: Backends, worker_id: str, **overrides: Any) -> AsyncIterator[str]:
    """A decoder service running until the block ends; yields its address once heard of."""
    env = env_of(
        data_dir=backends.data_dir,
        database_url=backends.database_url,
        nats_url=backends.nats_url,
        device="cpu",
        decoder_port=0,
        worker_id=worker_id,
        heartbeat_interval_s=0.1,
        shutdown_grace_s=0.0,
        **overrides,
    )
    stop = asyncio.Event()
    service = asyncio.create_task(serve(KernelSettings.from_env(env), DecoderSettings.from_env(env), stop))
    try:
        registered = await until(
            lambda: decoders_by_id(backends.presence), lambda ds: worker_id in ds, what=f"{worker_id} to register"
        )
        yield registered[worker_id].address
    finally:
        stop.set()
        assert await service == 0


def job(job_id: str, *, num_images: int = 1, output_format: str = "png") -> JobRecord:
    """A job running on a sampler, about to be decoded."""
    new = new_job(id=job_id, prompt="p", steps=2, seed=11, num_images=num_images, output_format=output_format)
    return record(new, status=JobStatus.RUNNING, attempt=1, worker_id="sampler", progress_step=2, progress_total=2)


def latents(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(seed))


async def decode_directly(address: str, z: torch.Tensor) -> None:
    """Sends latents to one decoder, bypassing any choice."""
    array = z.numpy().astype("<f4")
    request = vae_decoder_pb2.DecodeRequest(
        model="tiny",
        latents=array.tobytes(),
        shape=list(array.shape),
        jobs=[vae_decoder_pb2.DecodeJob(job_id="direct", images=len(z))],
    )
    async with channel(address) as ch:
        async for _ in vae_decoder_pb2_grpc.VaeDecoderStub(ch).Decode(request):
            pass


async def register_unreachable_decoder(nats_server: EmbeddedNats, presence: PresenceView) -> None:
    """A decoder that heartbeats but listens nowhere."""
    address = f"127.0.0.1:{free_port()}"
    hb = WorkerHeartbeat("unreachable", WorkerKind.DECODER, address, "cpu", models=("tiny",), warm_models=())
    nc = await nats.connect(nats_server.url)
    try:
        board = await PresenceBoard.open(nc.jetstream())
        await board.announce(Announcement(hb, "incarnation", time.time()))
    finally:
        await nc.close()
    await until(lambda: decoders_by_id(presence), lambda ds: "unreachable" in ds, what="the unreachable decoder")


def telemetry(ds: dict[str, WorkerRecord], worker_id: str) -> dict[str, Any]:
    return ds[worker_id].telemetry if worker_id in ds else {}


async def test_latents_go_to_the_decoder_that_will_finish_first(backends: Backends) -> None:
    # "busy" gathers up to 8 images for a minute: requests sent to it wait there,
    # and it heartbeats them as its queue; "idle" decodes at once.
    async with (
        decoder_service(backends, "busy", decode_batch_wait_ms=60_000, decode_max_batch=8) as busy,
        decoder_service(backends, "idle", decode_max_batch=8) as idle,
    ):
        # A full batch on each: both have measured their speed.
        await asyncio.gather(decode_directly(busy, latents(8)), decode_directly(idle, latents(8)))
        waiting = [asyncio.create_task(decode_directly(busy, latents(1, seed=i))) for i in range(7)]
        try:
            await until(
                lambda: decoders_by_id(backends.presence),
                lambda ds: (
                    telemetry(ds, "busy").get("queued_images") == 7
                    and all(telemetry(ds, d).get("seconds_per_megapixel") for d in ("busy", "idle"))
                ),
                what="both speeds measured and the busy decoder's queue heartbeated",
            )
            # Both count as live however late their next heartbeats come: under load
            # (a run of the suite) this process's NATS connection dropped for seconds,
            # "idle" went unheard past STALE_AFTER_S and was left out, rightly.
            decoders = Decoders(backends.presence, stale_after_s=600.0)
            try:
                # In rotation, one of these would start on "busy" and fill its batch.
                for i in range(3):
                    images = await decoders.decode(job(f"j{i}"), latents(1, seed=100 + i))
                    assert [(im.width, im.height, im.mime_type) for im in images] == [(64, 64, "image/png")]
            finally:
                await decoders.close()
            # Heartbeated once all three are counted, wherever they went.
            ds = await until(
                lambda: decoders_by_id(backends.presence),
                lambda ds: sum(telemetry(ds, d).get("decoded_images", 0) for d in ("busy", "idle")) >= 8 + 8 + 3,
                what="the decoders to heartbeat the three decodes",
            )
            assert telemetry(ds, "busy")["decoded_batches"] == 1, "a job's latents went to the busy decoder"
            assert telemetry(ds, "busy")["queued_images"] == 7
            assert telemetry(ds, "idle")["decoded_images"] == 8 + 3
        finally:
            for task in waiting:
                task.cancel()


async def test_a_degenerate_decode_is_tried_on_the_next_decoder(
    backends: Backends, models_dir: Path, tmp_path: Path
) -> None:
    flat = str(flat_vae_registry(models_dir, tmp_path))
    async with (
        decoder_service(backends, "flat", model_registry=flat),
        decoder_service(backends, "good"),
    ):
        decoders = Decoders(backends.presence, stale_after_s=STALE_AFTER_S)
        try:
            # Speeds unknown: in rotation, so one of the two starts on "flat".
            for i in range(2):
                [image] = await decoders.decode(job(f"j{i}"), latents(1, seed=i))
                with Image.open(io.BytesIO(image.data)) as img:
                    assert np.asarray(img).std() > 1, "a flat image came back"
        finally:
            await decoders.close()
        ds = await until(
            lambda: decoders_by_id(backends.presence),
            lambda ds: (
                telemetry(ds, "flat").get("decoded_images", 0) >= 1 and telemetry(ds, "good").get("decoded_images") == 2
            ),
            what="the flat decoder to have tried once and the good one to have decoded both",
        )
        assert telemetry(ds, "flat")["decoded_images"] == 1


async def test_the_sampler_decodes_locally_in_the_jobs_format_when_no_decoder_is_reachable(
    nats_server: EmbeddedNats, presence: PresenceView, models_dir: Path
) -> None:
    await register_unreachable_decoder(nats_server, presence)
    local = LocalDecoder(VaeDecoderEngine(ModelRegistry.load(), models_dir, torch.device("cpu")))
    decoders = Decoders(presence, stale_after_s=STALE_AFTER_S, local=local)
    try:
        z = latents(2, seed=5)
        images = await decoders.decode(job("local", num_images=2, output_format="webp"), z)
    finally:
        await decoders.close()
    assert [(im.index, im.mime_type, im.width, im.height) for im in images] == [
        (0, "image/webp", 64, 64),
        (1, "image/webp", 64, 64),
    ]
    for image, alone in zip(images, local.engine.decode("tiny", z), strict=True):
        assert image.data == encode(alone, "image/webp")
        with Image.open(io.BytesIO(image.data)) as img:
            assert img.format == "WEBP"


async def test_a_batch_the_sampler_keeps_decodes_here_and_one_it_sends_never_falls_back_unasked(
    nats_server: EmbeddedNats, presence: PresenceView, models_dir: Path
) -> None:
    """A group's local decoder (its videos, split across it): what it keeps decodes
    here before any decoder is asked; the rest waits for a decoder service, and
    without ``local_decode_fallback`` never falls back to it."""
    await register_unreachable_decoder(nats_server, presence)
    local = LocalDecoder(VaeDecoderEngine(ModelRegistry.load(), models_dir, torch.device("cpu")))
    decoders = Decoders(
        presence,
        stale_after_s=STALE_AFTER_S,
        patience_s=1.0,
        local=local,
        falls_back=False,
        keep=lambda jobs: local.decode_batch(jobs) if jobs[0][0].id == "kept" else None,
    )
    try:
        z = latents(1, seed=6)
        [image] = await decoders.decode(job("kept"), z)
        with pytest.raises(DecodeUnavailable) as err:
            await decoders.decode(job("sent"), latents(1))
    finally:
        await decoders.close()
    assert image.data == encode(local.engine.decode("tiny", z)[0], "image/png")
    assert "unreachable" in str(err.value)


async def test_without_a_reachable_decoder_or_local_fallback_the_decode_is_unavailable(
    nats_server: EmbeddedNats, presence: PresenceView
) -> None:
    await register_unreachable_decoder(nats_server, presence)
    decoders = Decoders(presence, stale_after_s=STALE_AFTER_S, patience_s=1.0)
    try:
        with pytest.raises(DecodeUnavailable) as err:
            await decoders.decode(job("nowhere"), latents(1))
    finally:
        await decoders.close()
    assert "unreachable" in str(err.value)


async def test_without_a_reachable_decoder_a_served_prompt_is_unavailable_and_retried(
    nats_server: EmbeddedNats, presence: PresenceView
) -> None:
    """A model whose text encoders are the decoder service's, and no decoder answers:
    the attempt fails with a retryable error that blames no sampler."""
    from gpu_worker.decoding.prompt_encoders import PromptEncodeUnavailable, served_conditioning
    from gpu_worker.jobs.failures import classify

    await register_unreachable_decoder(nats_server, presence)
    decoders = Decoders(presence, stale_after_s=STALE_AFTER_S, patience_s=1.0)
    try:
        with pytest.raises(PromptEncodeUnavailable) as err:
            await served_conditioning(decoders, job("nowhere"), guided=False)
    finally:
        await decoders.close()
    assert "unreachable" in str(err.value) and "encode the prompt" in str(err.value)
    failure = classify(err.value)
    assert failure.retryable and not failure.blames_worker
