"""One OpenAI SDK call is one job. The official `openai` SDK, with its default
retries (two, on every status of 500 and above and on timeouts) and its default
timeout, against a real stack whose jobs fail, whose gateway dies while the HTTP
API waits, and whose jobs outlast the SDK's timeout: the jobs are counted in
PostgreSQL, never in logs. And an ``Idempotency-Key`` makes a repeated request,
on either door that submits, the same job."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psycopg
import pytest
from openai.types import ImagesResponse

from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack
from tests.helpers import png_size, stub, wait_for, wait_terminal

pytestmark = pytest.mark.integration

# tiny and tiny-wan, and a model whose every attempt runs past its timeout: its jobs fail.
REGISTRY = """
[models.tiny]
source = "builtin:tiny"
family = "tiny"
dtype = "float32"
vram_mb = 16
max_width = 512
max_height = 512
default_width = 64
default_height = 64
max_steps = 100
max_images = 4

[models.slow]
source = "builtin:tiny"
family = "tiny"
dtype = "float32"
vram_mb = 16
max_steps = 500
timeout_s = 1.0

[models.tiny-wan]
source = "builtin:tiny-wan"
family = "wan"
dtype = "float32"
vram_mb = 32
min_size = 32
max_width = 256
max_height = 256
size_step = 16
max_steps = 50
max_frames = 33
default_frames = 9
frames_step = 4
default_fps = 8
"""


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("http-retries")
    registry = tmp / "registry.toml"
    registry.write_text(REGISTRY)
    s = make_stack(tmp / "stack", postgres, models_dir, http=True, model_registry=str(registry))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def sdk(stack: LocalStack, **options: float) -> openai.OpenAI:
    """The SDK as its users have it: default retries, default timeout unless given."""
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="anything: the gateway is open", **options)  # type: ignore[arg-type]


def long_job(client: openai.OpenAI, prompt: str) -> ImagesResponse:
    """A job that takes a while on a CPU (it is cancelled once its wait is over)."""
    return client.images.generate(model="tiny", prompt=prompt, size="512x512", n=4, extra_body={"steps": 100})


def medium_job(client: openai.OpenAI, prompt: str) -> ImagesResponse:
    """A job of some seconds on a CPU."""
    return client.images.generate(model="tiny", prompt=prompt, size="256x256", extra_body={"steps": 60})


def jobs_of(stack: LocalStack, prompt: str) -> list[tuple[str, str]]:
    """Every stored job with ``prompt``: (id, status), as PostgreSQL has them."""
    with psycopg.connect(stack.pg_url) as conn:
        rows = conn.execute("SELECT id, status FROM jobs WHERE prompt = %s ORDER BY created_at", (prompt,)).fetchall()
    return [(r[0], r[1]) for r in rows]


def unique(what: str) -> str:
    return f"{what} {uuid.uuid4().hex[:8]}"


def test_a_failing_job_is_one_job_and_one_answer(stack: LocalStack) -> None:
    """It used to be a 500 that the SDK retried twice: three jobs, each failing."""
    prompt = unique("fails")
    with pytest.raises(openai.InternalServerError) as failed:
        sdk(stack).images.generate(model="slow", prompt=prompt, size="256x256", extra_body={"steps": 400})
    error = failed.value
    assert isinstance(error.body, dict) and error.body["code"] == "job_failed", error.body
    assert jobs_of(stack, prompt) == [(error.body["job_id"], "FAILED")]
    assert error.status_code == 500 and error.response.headers["x-should-retry"] == "false"


def test_a_gateway_that_dies_mid_wait_is_waited_for_and_the_job_answered(stack: LocalStack) -> None:
    prompt = unique("the gateway dies")
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(medium_job, sdk(stack), prompt)
        running = wait_for(
            lambda: jobs_of(stack, prompt), lambda rows: bool(rows) and rows[0][1] == "RUNNING", timeout=60, what="it"
        )
        gateway = stack.services["gateway"]
        gateway.kill()
        gateway.start()
        answer = call.result(timeout=120)
    stack.wait_ready(60)
    assert answer.data is not None and png_size(base64.b64decode(answer.data[0].b64_json or "")) == (256, 256)
    assert jobs_of(stack, prompt) == [(running[0][0], "SUCCEEDED")]
    # It was followed across the restart (the scenario happened), not finished before it.
    assert f"job {running[0][0]}: the gateway is away" in stack.services["http"].log_tail(100_000)


def test_a_job_past_the_sdk_s_timeout_is_answered_before_it_and_named(stack: LocalStack) -> None:
    """The SDK announces its read timeout; the answer comes before it, naming the
    job, so that the SDK neither times out nor submits again."""
    prompt = unique("outlasts the timeout")
    began = time.monotonic()
    with pytest.raises(openai.InternalServerError) as running:
        long_job(sdk(stack, timeout=5.0), prompt)
    took = time.monotonic() - began
    error = running.value
    assert error.status_code == 504 and error.response.headers["x-should-retry"] == "false"
    assert isinstance(error.body, dict) and error.body["code"] == "job_running", error.body
    job_id = error.body["job_id"]
    assert f"/v1/jobs/{job_id}" in error.body["message"] and 3.5 < took < 5.0, took
    assert [j for j, _ in jobs_of(stack, prompt)] == [job_id]
    followed = httpx.get(f"{stack.http_url}/v1/jobs/{job_id}").json()
    assert followed["id"] == job_id and followed["status"] in ("queued", "scheduled", "running", "decoding")

    # Prefer: respond-async, wait=N (RFC 7240): the job to follow, after N seconds at most.
    other = unique("respond-async after a wait")
    began = time.monotonic()
    posted = httpx.post(
        f"{stack.http_url}/v1/images/generations",
        json={"prompt": other, "model": "tiny", "size": "512x512", "n": 4, "steps": 100},
        headers={"Prefer": "respond-async, wait=1"},
        timeout=30,
    )
    assert posted.status_code == 202 and 1.0 <= time.monotonic() - began < 5.0
    assert posted.json()["status"] != "succeeded" and [j for j, _ in jobs_of(stack, other)] == [posted.json()["id"]]
    for ending in (job_id, posted.json()["id"]):
        stub(stack).CancelJob(pb.CancelJobRequest(job_id=ending))
        wait_terminal(stub(stack), ending, timeout=60)


def test_an_idempotency_key_makes_a_repeated_request_the_same_job(stack: LocalStack) -> None:
    prompt, key = unique("once"), uuid.uuid4().hex
    first = httpx.post(
        f"{stack.http_url}/v1/images/generations",
        json={"prompt": prompt, "model": "tiny", "size": "64x64", "steps": 2},
        headers={"Prefer": "respond-async", "Idempotency-Key": key},
    )
    assert first.status_code == 202, first.text
    # The SDK's request with the same key: the same job, its image.
    again = sdk(stack).images.generate(
        prompt=prompt, model="tiny", size="64x64", extra_body={"steps": 2}, extra_headers={"Idempotency-Key": key}
    )
    assert again.data and png_size(base64.b64decode(again.data[0].b64_json or "")) == (64, 64)
    assert [j for j, _ in jobs_of(stack, prompt)] == [first.json()["id"]]
    # Without one, each request is a job of its own.
    for _ in range(2):
        httpx.post(
            f"{stack.http_url}/v1/images/generations",
            json={"prompt": prompt, "model": "tiny", "size": "64x64", "steps": 2},
            headers={"Prefer": "respond-async"},
        )
    assert len(jobs_of(stack, prompt)) == 3

    # The videos door too.
    video, video_key = unique("a video, once"), uuid.uuid4().hex
    made = [
        sdk(stack)
        .videos.create(
            prompt=video, extra_body={"size": "64x48", "steps": 2, "frames": 5}, extra_headers={"Idempotency-Key": k}
        )
        .id
        for k in (video_key, video_key)
    ]
    assert made[0] == made[1] and [j for j, _ in jobs_of(stack, video)] == [made[0]]
    wait_terminal(stub(stack), made[0], timeout=60)
