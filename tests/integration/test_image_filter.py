"""The image filter changes what the client receives, through the whole real stack
(gateway, scheduler, sampler, decoder, PostgreSQL, NATS, the HTTP door and the
OpenAI SDK): the same flagged output (tests/fixtures/flagged.png, made by a ``sim``
model whose latents decode to it exactly) is returned as made and marked under
"flag", blurred under "blur", withheld under "block" (over HTTP: OpenAI's
content_policy_violation); an ordinary output passes with a low score; and with
the filter off nothing is scored. A sampler decoding its own latents judges them
the same way."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from gpu_worker.decoding.local_decode import LocalDecoder
from services.config.safety import SafetySettings
from services.db.records import JobRecord
from services.models import sim
from services.models.registry import ModelRegistry
from services.models.vae import VaeDecoderEngine
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.image_filter import load_image_filter
from tests.conftest import make_stack
from tests.helpers import stub, wait_terminal
from tests.records import record

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).parents[1] / "fixtures" / "flagged.png"
THRESHOLD = 0.8
# Lanes whose flagged outputs are flagged, blurred and blocked.
LANES = "paid:10,blurred:5,free:0"
POLICIES = "paid:flag,blurred:blur,free:block"
SIM = """
source = "builtin:sim"
family = "sim"
dtype = "float32"
vram_mb = 1
min_size = 64
max_width = 256
max_height = 256
default_width = 128
default_height = 128
default_steps = 2
max_steps = 10
step_ms_512 = 64
load_s = 0.01
"""


def registry(where: Path) -> Path:
    """``flagged``: a sim model whose every output is the fixture; ``plain``: a sim
    model's ordinary output (its seed's latents through the projection)."""
    path = where / "registry.toml"
    path.write_text(f'[models.flagged]{SIM}default = true\nsim_image = "{FIXTURE}"\n\n[models.plain]{SIM}')
    return path


def fixture_pixels() -> np.ndarray:
    with Image.open(FIXTURE) as image:
        return np.asarray(image.convert("RGB"))


def pixels_of(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def started(tmp: Path, pg: EmbeddedPostgres, models: Path, **values: Any) -> LocalStack:
    stack = make_stack(tmp, pg, models, model_registry=registry(tmp.parent), preload_models=(), lanes=LANES, **values)
    stack.start()
    return stack


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    s = started(tmp_path_factory.mktemp("filter") / "stack", postgres, models_dir, output_policies=POLICIES, http=True)
    try:
        yield s
    finally:
        s.stop()


def made(client, model: str, lane: str) -> tuple[pb.Job, list[pb.ImageChunk]]:  # type: ignore[no-untyped-def]
    """The finished job (GetJob: as stored) and the image chunks its stream sent."""
    job_id = client.SubmitJob(pb.SubmitJobRequest(model=model, prompt="a test card", lane=lane, seed=5)).job_id
    events = list(client.StreamJob(pb.StreamJobRequest(job_id=job_id), timeout=120))
    job = wait_terminal(client, job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    return job, [e.image_chunk for e in events if e.HasField("image_chunk")]


def test_the_verdict_changes_what_the_client_receives(stack: LocalStack) -> None:
    client = stub(stack)
    fixture = fixture_pixels()

    flagged, chunks = made(client, "flagged", "paid")
    [image] = flagged.images
    assert flagged.output_policy == "flag"
    assert image.verdict == "flagged" and image.nsfw_score >= 0.9
    assert np.array_equal(pixels_of(image.data), fixture)  # as made, byte for byte the picture
    assert all(c.verdict == "flagged" and c.nsfw_score == image.nsfw_score for c in chunks)
    assert b"".join(c.data for c in chunks) == image.data

    blurred, chunks = made(client, "flagged", "blurred")
    [soft] = blurred.images
    assert blurred.output_policy == "blur"
    assert soft.verdict == "blurred" and soft.nsfw_score == image.nsfw_score
    assert soft.data and soft.data != image.data
    soft_pixels = pixels_of(soft.data)
    assert soft_pixels.shape == fixture.shape
    # The blocks' edges are gone: neighbouring pixels differ far less than the picture's.
    edges = [np.abs(np.diff(p.astype(int), axis=1)).mean() for p in (soft_pixels, fixture)]
    assert edges[0] < edges[1] / 4
    assert all(c.verdict == "blurred" for c in chunks)

    blocked, chunks = made(client, "flagged", "free")
    [withheld] = blocked.images
    assert blocked.output_policy == "block"
    assert withheld.verdict == "blocked" and withheld.nsfw_score == image.nsfw_score
    assert withheld.data == b"" and (withheld.width, withheld.height) == (128, 128)
    [chunk] = chunks  # one chunk, the last, with no data
    assert chunk.last and chunk.data == b"" and chunk.verdict == "blocked"

    ordinary, chunks = made(client, "plain", "free")
    [passed] = ordinary.images
    assert ordinary.output_policy == "block"
    assert passed.verdict == "" and passed.HasField("nsfw_score") and passed.nsfw_score < 0.1
    assert pixels_of(passed.data).shape == (128, 128, 3)


def test_the_openai_sdk_gets_the_image_or_a_content_policy_violation(stack: LocalStack) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="open", timeout=120, max_retries=0)
    flagged = sdk.images.generate(
        model="flagged", prompt="a test card", size="128x128", extra_body={"lane": "paid", "seed": 5}
    )
    [only] = flagged.data or []
    assert np.array_equal(pixels_of(base64.b64decode(only.b64_json or "")), fixture_pixels())
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.images.generate(model="flagged", prompt="a test card", size="128x128", extra_body={"lane": "free"})
    assert refused.value.code == "content_policy_violation"
    assert refused.value.status_code == 400


def darkroom_generate(stack: LocalStack, model: str, prompt: str, out: Path) -> subprocess.CompletedProcess[str]:
    args = ["generate", prompt, "--gateway", stack.gateway_address, "--model", model, "-o", str(out), "--seed", "5"]
    command = [sys.executable, "-m", "services.ops.cli", *args, "--width", "128", "--height", "128"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_darkroom_generate_says_what_the_filters_did(stack: LocalStack, tmp_path: Path) -> None:
    # The open stack's jobs run in the lowest lane, free, whose flagged outputs are blocked.
    withheld = darkroom_generate(stack, "flagged", "a test card", tmp_path / "flagged.png")
    assert withheld.returncode == 1, withheld.stderr
    assert "withheld (the image filter flagged it)" in withheld.stderr
    assert not (tmp_path / "flagged.png").exists()

    refused = darkroom_generate(stack, "plain", "a f*cking test card", tmp_path / "refused.png")
    assert refused.returncode == 1
    assert "INVALID_ARGUMENT" in refused.stderr and "violates the content policy" in refused.stderr
    assert "f*cking" not in refused.stderr and "fuck" not in refused.stderr  # never which word
    assert not (tmp_path / "refused.png").exists()

    passed = darkroom_generate(stack, "plain", "a test card", tmp_path / "plain.png")
    assert passed.returncode == 0, passed.stderr
    assert pixels_of((tmp_path / "plain.png").read_bytes()).shape == (128, 128, 3)
    assert "image filter" not in passed.stdout


def test_with_the_filter_off_nothing_is_scored(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> None:
    stack = started(tmp_path / "stack", postgres, models_dir, image_filter=False)
    try:
        job, chunks = made(stub(stack), "flagged", "free")
        [image] = job.images
        assert job.output_policy == ""
        assert not image.HasField("nsfw_score") and image.verdict == ""
        assert np.array_equal(pixels_of(image.data), fixture_pixels())
        assert all(not c.HasField("nsfw_score") for c in chunks)
    finally:
        stack.stop()


def test_a_sampler_decoding_its_own_latents_judges_them_the_same_way(tmp_path: Path) -> None:
    models = ModelRegistry.load(registry(tmp_path))
    engine = VaeDecoderEngine(models, tmp_path, torch.device("cpu"))
    image_filter = load_image_filter(SafetySettings(image_filter_threshold=THRESHOLD))
    local = LocalDecoder(engine, image_filter)

    def job(job_id: str, model: str, policy: str) -> tuple[JobRecord, torch.Tensor]:
        stored = record(id=job_id, model=model, width=128, height=128, output_policy=policy)
        return stored, sim.latents(stored.params, models.get(model).sim_image)

    flagged = [job("flag", "flagged", "flag"), job("blur", "flagged", "blur"), job("block", "flagged", "block")]
    decoded = local.decode_batch([*flagged, job("unchecked", "flagged", "")])
    by_id = {job_id: images[0] for job_id, images in decoded.items() if isinstance(images, list)}
    assert sorted(by_id) == ["block", "blur", "flag", "unchecked"]
    assert [by_id[j].verdict for j in ("flag", "blur", "block", "unchecked")] == ["flagged", "blurred", "blocked", ""]
    assert by_id["flag"].nsfw_score is not None and by_id["flag"].nsfw_score >= 0.9
    assert by_id["unchecked"].nsfw_score is None
    assert np.array_equal(pixels_of(by_id["flag"].data), fixture_pixels())
    assert by_id["unchecked"].data == by_id["flag"].data
    assert by_id["blur"].data != by_id["flag"].data and by_id["block"].data == b""
    [plain] = local.decode_job(*job("plain", "plain", "block"))
    assert plain.verdict == "" and plain.nsfw_score is not None and plain.nsfw_score < 0.1
