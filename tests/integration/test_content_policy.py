"""The prompt filter and moderation on a real stack (PostgreSQL, NATS, the gateway,
a sampler, the HTTP door), for a tenant with credits and a key: a refused prompt
is INVALID_ARGUMENT naming only the field, with the reason
CONTENT_POLICY_VIOLATION, and leaves no job and no reservation behind; the same
prompt through OpenAI's SDK is its BadRequestError with code
content_policy_violation; a negative prompt of "nsfw, nude" is no refusal; and
Moderate, on gRPC and as POST /v1/moderations through the SDK, answers texts
with the filter's categories and images with open_nsfw's score, over HTTP in
OpenAI's whole shape; the HTTP door counts and measures inputs before the gateway
sees any; 32 images of 4096x4096 are scored one at a time at the classifier's size;
and a call draws on its tenant's rate."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import psycopg
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from openai.types import ModerationMultiModalInputParam
from PIL import Image

from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.safety.image_filter import OpenNsfw
from tests.conftest import make_stack, running
from tests.helpers import quota_failure, stub
from tests.integration.test_tenants import as_key, darkroom, metric_samples

pytestmark = pytest.mark.integration

TENANT = "owls"
REFUSED = "a p0rn star on a beach"  # leetspeak: the filter reads "porn"
JOB: dict[str, Any] = {"model": "tiny", "width": 64, "height": 64, "steps": 2}
FLAGGED_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "flagged.png"
SKIN = (224, 172, 140)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    yield from running(make_stack(tmp_path_factory.mktemp("content-policy"), postgres, models_dir, http=True))


@pytest.fixture(scope="module")
def key(stack: LocalStack) -> str:
    """A key of tenant owls, on the free lane with 1,000 credits: the gateway is closed from here on."""
    darkroom(stack, "tenants", "create", TENANT, "--lane", "free", "--credits", "1000")
    return darkroom(stack, "keys", "create", TENANT).stdout.strip().splitlines()[-1]


def sdk(stack: LocalStack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=key, timeout=60, max_retries=0)


def books(stack: LocalStack) -> tuple[Any, ...]:
    """What the database holds of the tenant: its jobs, their reservations, its row
    (balance, rate bucket, day) and its credit ledger."""
    url = stack.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        jobs = conn.execute(
            "SELECT count(*), coalesce(sum(credits_reserved), 0) FROM jobs WHERE tenant = %s", (TENANT,)
        ).fetchone()
        tenant = conn.execute("SELECT * FROM tenants WHERE name = %s", (TENANT,)).fetchone()
        ledger = conn.execute("SELECT count(*) FROM credit_entries WHERE tenant = %s", (TENANT,)).fetchone()
    return jobs, tenant, ledger


def refusal_details(err: grpc.RpcError) -> tuple[list[tuple[str, str]], list[str]]:
    """The BadRequest's (field, description) pairs and the ErrorInfo reasons of a refusal."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no rich status details"
    fields, reasons = [], []
    for detail in status.details:
        bad, info = error_details_pb2.BadRequest(), error_details_pb2.ErrorInfo()
        if detail.Unpack(bad):
            fields += [(v.field, v.description) for v in bad.field_violations]
        elif detail.Unpack(info):
            reasons.append(info.reason)
    return fields, reasons


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_a_refused_prompt_stores_nothing_and_reserves_nothing(stack: LocalStack, key: str) -> None:
    client = stub(stack)
    before = books(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.SubmitJob(pb.SubmitJobRequest(prompt=REFUSED, **JOB), metadata=as_key(key))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields, reasons = refusal_details(err.value)
    assert fields == [("prompt", "violates the content policy")]
    assert reasons == ["CONTENT_POLICY_VIOLATION"]
    assert "porn" not in err.value.details() and "p0rn" not in err.value.details()  # nothing of what matched
    assert books(stack) == before

    # A negative prompt is never checked: it names what to steer away from.
    accepted = client.SubmitJob(
        pb.SubmitJobRequest(prompt="a lighthouse", negative_prompt="nsfw, nude, p0rn", **JOB), metadata=as_key(key)
    )
    jobs, _, _ = books(stack)
    assert accepted.job_id and jobs[0] == before[0][0] + 1 and jobs[1] > 0  # stored, and its credits reserved

    gateway = metric_samples(stack, "gateway")
    assert gateway[("darkroom_prompts_refused_total", (("lane", "free"),))] == 1
    assert gateway[("darkroom_tenant_refusals_total", (("reason", "content_policy"), ("tenant", TENANT)))] == 1


def test_the_sdk_raises_its_bad_request_error_with_openai_s_code(stack: LocalStack, key: str) -> None:
    before = books(stack)
    with pytest.raises(openai.BadRequestError) as err:
        sdk(stack, key).images.generate(model="tiny", prompt=REFUSED, size="64x64", extra_body={"steps": 2})
    assert err.value.status_code == 400
    assert err.value.code == "content_policy_violation" and err.value.param == "prompt"
    assert err.value.type == "invalid_request_error"
    assert books(stack) == before


def test_moderate_on_grpc_answers_texts_and_images(stack: LocalStack, key: str) -> None:
    client = stub(stack)
    skin = np.full((512, 512, 3), SKIN, dtype=np.uint8)
    [expected] = OpenNsfw().scores([skin])  # the classifier the gateway runs, on the same pixels
    request = pb.ModerateRequest(
        inputs=[
            pb.ModerationInput(text="a lighthouse at dusk"),
            pb.ModerationInput(text="s e x"),
            pb.ModerationInput(image=png(skin)),
        ]
    )
    clean, spelled, image = client.Moderate(request, metadata=as_key(key)).results
    assert not clean.flagged and dict(clean.categories) == {"profanity": False, "sexual": False}
    assert spelled.flagged and dict(spelled.categories) == {"profanity": True, "sexual": True}
    assert set(image.categories) == {"sexual"}
    assert image.category_scores["sexual"] == pytest.approx(expected, abs=1e-5)
    threshold = stack.settings.kernel.safety.image_filter_threshold
    assert image.flagged == image.categories["sexual"] == (expected >= threshold)

    with pytest.raises(grpc.RpcError) as err:
        client.Moderate(pb.ModerateRequest(inputs=[pb.ModerationInput(image=b"not an image")]), metadata=as_key(key))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in refusal_details(err.value)[0]] == ["inputs[0].image"]
    with pytest.raises(grpc.RpcError) as err:
        client.Moderate(request)  # no key, and the gateway has tenants
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.skipif(
    not FLAGGED_FIXTURE.exists(), reason="tests/fixtures/flagged.png is made by the image filter's work"
)
def test_moderate_flags_the_fixture_open_nsfw_flags(stack: LocalStack, key: str) -> None:
    request = pb.ModerateRequest(inputs=[pb.ModerationInput(image=FLAGGED_FIXTURE.read_bytes())])
    [result] = stub(stack).Moderate(request, metadata=as_key(key)).results
    assert result.flagged and result.categories["sexual"] and result.category_scores["sexual"] >= 0.8


def test_the_sdk_s_moderations_create_parses_darkroom_s_answer(stack: LocalStack, key: str) -> None:
    client = sdk(stack, key)
    texts = client.moderations.create(input=["a lighthouse", "a b00bs poster"], model="omni-moderation-latest")
    assert texts.id.startswith("modr-") and len(texts.results) == 2
    clean, flagged = texts.results
    assert not clean.flagged and clean.categories.sexual is False
    assert flagged.flagged and flagged.categories.sexual is True and flagged.category_scores.sexual == 1.0
    assert (flagged.categories.model_extra or {})["profanity"] is True  # Darkroom's own category, beside OpenAI's
    # Every category OpenAI's schema requires; one not checked is false and applied to no input.
    assert flagged.categories.violence is False and flagged.category_scores.violence == 0.0
    assert flagged.category_applied_input_types is not None
    assert flagged.category_applied_input_types.violence == []
    assert flagged.category_applied_input_types.sexual == ["text"]

    image = png(np.full((256, 256, 3), SKIN, dtype=np.uint8))
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    given: list[ModerationMultiModalInputParam] = [
        {"type": "text", "text": "a portrait"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    parts = client.moderations.create(input=given)
    [together] = parts.results  # an array of parts is one input, as OpenAI answers it
    assert together.category_applied_input_types is not None
    assert together.category_applied_input_types.sexual == ["image", "text"]
    assert 0.0 < (together.category_scores.sexual or 0.0) < 1.0  # the image's score, above the text's 0

    for part, param in (
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "input[1].image_url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, "input[1].image_url"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.moderations.create(input=[{"type": "text", "text": "a"}, part])  # type: ignore[arg-type]
        assert err.value.param == param


def moderate_calls(stack: LocalStack) -> float:
    """Moderate calls the gateway has answered, whatever their status."""
    return sum(
        value
        for (name, labels), value in metric_samples(stack, "gateway").items()
        if name == "darkroom_rpc_requests_total" and ("method", "/darkroom.v1.ImageGeneration/Moderate") in labels
    )


def test_the_http_door_refuses_a_flood_of_inputs_before_the_gateway_sees_one(stack: LocalStack, key: str) -> None:
    before = moderate_calls(stack)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{stack.http_url}/v1/moderations"
    # 1.1 MiB that became 200,000 inputs at the door, before the gateway's cap of 32 was checked.
    flood = httpx.post(url, content=b'{"input": [' + b'"a",' * 200_000 + b'"a"]}', headers=headers, timeout=60)
    assert flood.status_code == 400 and flood.json()["error"]["param"] == "body", flood.text[:300]
    one_too_many = httpx.post(url, json={"input": ["a"] * 33}, headers=headers, timeout=60)
    assert one_too_many.status_code == 400
    assert one_too_many.json()["error"]["param"] == "input" and "33 inputs" in one_too_many.json()["error"]["message"]
    too_long = httpx.post(url, json={"input": ["a", "x" * 2001]}, headers=headers, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input[1]"
    assert moderate_calls(stack) == before


def peak_rss_growth(pid: int, call: Callable[[], object]) -> int:
    """How far ``call`` raises process ``pid``'s peak resident memory (VmHWM,
    reset first through /proc/PID/clear_refs)."""
    status = Path(f"/proc/{pid}/status")

    def kib(field: str) -> int:
        [line] = [line for line in status.read_text().splitlines() if line.startswith(field + ":")]
        return int(line.split()[1])

    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak, back to what is resident now
    before = kib("VmRSS")
    call()
    return (kib("VmHWM") - before) * 1024


def test_a_call_of_32_large_images_holds_one_at_a_time(stack: LocalStack, key: str) -> None:
    """32 images of 4096x4096 (a 50 KiB PNG each, 48 MiB of pixels) were decoded whole
    and held together: 1.5 GiB for one call. Each is now brought down to the
    classifier's input as it is decoded, and scored alone."""
    client = stub(stack)
    large = png(np.full((4096, 4096, 3), SKIN, dtype=np.uint8))
    small = png(np.full((256, 256, 3), SKIN, dtype=np.uint8))
    [expected] = client.Moderate(
        pb.ModerateRequest(inputs=[pb.ModerationInput(image=small)]), metadata=as_key(key)
    ).results
    request = pb.ModerateRequest(inputs=[pb.ModerationInput(image=large)] * 32)
    answered: list[pb.ModerateResponse] = []
    pid = stack.services["gateway"].pid
    assert pid is not None
    grown = peak_rss_growth(
        pid,
        lambda: answered.append(client.Moderate(request, metadata=as_key(key), timeout=120)),
    )
    assert grown < 300 * 2**20, f"the gateway's peak grew {grown / 2**20:.0f} MiB"
    [response] = answered
    assert len(response.results) == 32
    # A uniform image scores as its smaller self: downscaled, the same pixels.
    assert {round(r.category_scores["sexual"], 5) for r in response.results} == {
        round(expected.category_scores["sexual"], 5)
    }


def test_moderate_draws_on_its_tenant_s_rate_limit(stack: LocalStack, key: str) -> None:
    darkroom(stack, "tenants", "create", "larks", "--lane", "free", "--rate", "0.001")
    larks = darkroom(stack, "keys", "create", "larks").stdout.strip().splitlines()[-1]
    request = pb.ModerateRequest(inputs=[pb.ModerationInput(text="a heron")])
    client = stub(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.Moderate(pb.ModerateRequest(), metadata=as_key(larks))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # a mistake draws nothing on the bucket
    client.Moderate(request, metadata=as_key(larks))  # its bucket's one call
    with pytest.raises(grpc.RpcError) as err:
        client.Moderate(request, metadata=as_key(larks))
    quota = quota_failure(err.value)
    assert quota.violations[0].subject == "tenant:larks" and "rate" in quota.violations[0].description
    refused = sdk(stack, larks)
    with pytest.raises(openai.RateLimitError) as limited:
        refused.moderations.create(input="a heron")
    assert int(limited.value.response.headers["Retry-After"]) > 1
    # Another tenant's bucket is its own: owls have no rate limit.
    assert len(client.Moderate(request, metadata=as_key(key)).results) == 1
