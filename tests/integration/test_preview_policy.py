"""Previews under the output policy, through the real stack (gateway, scheduler, a
sampler, a decoder, PostgreSQL, NATS, the HTTP door and the OpenAI SDK): a preview
is never scored by the image filter, so a tenant whose flagged outputs are blocked
or blurred (its own policy, or its lane's) gets none, over StreamJob or as
partial_image events, though it asks for them; its job still succeeds and its
image still comes. A tenant whose outputs are delivered as made ("flag") gets
them."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest
from openai.types import ImageEditCompletedEvent

from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import png_size, stub
from tests.integration.test_http_api import png
from tests.integration.test_tenants import as_key, darkroom

pytestmark = pytest.mark.integration

# Each tenant's options, the output policy its jobs are checked under, and the steps
# after which a job of 30 steps asking for three previews has them sent.
TENANTS = {
    "blocks": (("--lane", "paid", "--output-policy", "block"), "block", []),
    "blurs": (("--lane", "paid", "--output-policy", "blur"), "blur", []),
    "on-free": (("--lane", "free"), "block", []),  # the free lane's policy (DARKROOM_OUTPUT_POLICIES' default)
    "flags": (("--lane", "paid", "--output-policy", "flag"), "flag", [8, 15, 22]),
}
# Enough steps that the stream is following before the first preview is taken.
JOB: dict[str, Any] = {"model": "tiny", "prompt": "a lighthouse", "width": 64, "height": 64, "steps": 30, "seed": 3}


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    yield from running(make_stack(tmp_path_factory.mktemp("previews"), postgres, models_dir, http=True))


@pytest.fixture(scope="module")
def keys(stack: LocalStack) -> dict[str, str]:
    out = {}
    for name, (options, _, _) in TENANTS.items():
        darkroom(stack, "tenants", "create", name, "--credits", "1000", *options)
        out[name] = darkroom(stack, "keys", "create", name).stdout.strip().splitlines()[-1]
    return out


def sdk(stack: LocalStack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=key, timeout=120, max_retries=0)


def stored_previews(stack: LocalStack, job_id: str) -> int:
    url = stack.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT previews FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("tenant", TENANTS)
def test_stream_job_sends_previews_only_where_outputs_leave_as_made(
    stack: LocalStack, keys: dict[str, str], tenant: str
) -> None:
    client, key = stub(stack), keys[tenant]
    job_id = client.SubmitJob(pb.SubmitJobRequest(**JOB, previews=3), metadata=as_key(key)).job_id
    events = list(client.StreamJob(pb.StreamJobRequest(job_id=job_id), metadata=as_key(key), timeout=120))
    terminal = events[-1].terminal
    assert terminal.status == pb.JOB_STATUS_SUCCEEDED, terminal.error
    assert terminal.output_policy == TENANTS[tenant][1]
    chunks = [e.image_chunk for e in events if e.HasField("image_chunk")]
    assert chunks and chunks[-1].last, "the image itself still comes"
    _, _, steps = TENANTS[tenant]
    assert [e.preview.step for e in events if e.HasField("preview")] == steps
    assert stored_previews(stack, job_id) == len(steps), "the job says what its stream sends"


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_streamed_generation_sends_partial_images_only_where_outputs_leave_as_made(
    stack: LocalStack, keys: dict[str, str], tenant: str
) -> None:
    stream = sdk(stack, keys[tenant]).images.generate(
        model="tiny", prompt="a fox", size="64x64", stream=True, partial_images=2, extra_body={"steps": 30, "seed": 3}
    )
    partials = 2 if TENANTS[tenant][2] else 0
    assert [e.type for e in stream] == ["image_generation.partial_image"] * partials + ["image_generation.completed"]


def test_a_streamed_edit_under_block_sends_no_partial_image(stack: LocalStack, keys: dict[str, str]) -> None:
    stream = sdk(stack, keys["blocks"]).images.edit(
        model="tiny",
        image=("in.png", png((64, 64), (200, 30, 60))),
        prompt="at night",
        stream=True,
        partial_images=1,
        extra_body={"steps": 30, "seed": 3, "strength": 1.0},
    )
    [completed] = list(stream)
    assert isinstance(completed, ImageEditCompletedEvent), completed.type
    assert png_size(base64.b64decode(completed.b64_json)) == (64, 64)
