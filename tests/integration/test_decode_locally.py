"""A sampler that decodes its own latents (``decode_locally``: a box whose decoder
would share its GPU) serves images, batches and edits without calling a decoder
service, and each job's image is byte for byte the one the decoder service makes."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from services.db.states import WorkerKind
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import stub, wait_terminal, workers_heard

pytestmark = pytest.mark.integration

SHAPE: dict[str, Any] = dict(model="tiny", width=64, height=64, steps=4, guidance_scale=7.5)


def picture() -> bytes:
    pixels = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


REQUESTS = [
    pb.SubmitJobRequest(**SHAPE, prompt="a red door", seed=1),
    pb.SubmitJobRequest(**SHAPE, prompt="a blue door", seed=2, num_images=2),
    pb.SubmitJobRequest(**SHAPE, prompt="at night", seed=3, image=picture(), strength=0.6),
]


@pytest.fixture(scope="module")
def local(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    """A sampler decoding locally, beside a decoder service it never calls (so that
    both stacks give their processes the same CPU threads: a CPU's results depend
    on them)."""
    stack = make_stack(tmp_path_factory.mktemp("decode-locally"), postgres, models_dir, decode_locally=True)
    stack.start()
    yield stack
    stack.stop()


async def decoded_by_the_service(stack: LocalStack, since: datetime) -> int:
    """Images the stack's decoder service has decoded, from its first heartbeat
    after ``since``."""
    deadline = time.monotonic() + 30
    while True:
        heard = await asyncio.to_thread(workers_heard, stack.settings.kernel, stale_after_s=60)
        [decoder] = [w for w in heard.values() if w.kind == WorkerKind.DECODER and w.live]
        if decoder.last_heartbeat > since:
            return int(decoder.telemetry["decoded_images"])
        assert time.monotonic() < deadline, "no heartbeat from the decoder"
        await asyncio.sleep(0.1)


def images_of(stack: LocalStack) -> list[list[bytes]]:
    client = stub(stack)
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        ids = [reply.job_id for reply in pool.map(client.SubmitJob, REQUESTS)]
    jobs = [wait_terminal(client, job_id) for job_id in ids]
    assert [j.status for j in jobs] == [pb.JOB_STATUS_SUCCEEDED] * len(jobs), [j.error for j in jobs]
    return [[image.data for image in job.images] for job in jobs]


async def test_a_sampler_decoding_locally_never_calls_a_decoder_and_makes_the_same_images(
    local: LocalStack, stack: LocalStack
) -> None:
    here = await asyncio.to_thread(images_of, local)
    assert [len(images) for images in here] == [1, 2, 1]
    assert await decoded_by_the_service(local, datetime.now(UTC)) == 0
    assert here == await asyncio.to_thread(images_of, stack)
    assert await decoded_by_the_service(stack, datetime.now(UTC)) == 4, "the other stack's decoder made them"
