"""Prompt expansion through the real stack, its gateway running the model expander
on the tiny GPT-2: a job that asks has its expanded prompt stored, returned (gRPC,
the HTTP door's ``revised_prompt``, ``darkroom generate --expand``) and sampled
from; an idempotent resubmit is answered as stored; a tenant's default applies
where a request says nothing; a submit its tenant's limits refuse is refused before
its prompt is expanded; and a gateway with expansion off refuses to expand before
anything is stored."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from gateway.service import create_server
from services.config.safety import ExpansionSettings
from services.config.sections import GatewaySettings, KernelSettings
from services.db.repository import Repository
from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.safety.lm_expansion import ModelExpander
from services.safety.vocabulary import Vocabulary, words_of
from tests.conftest import make_stack, migrated_database, running
from tests.helpers import quota_failure, stub, wait_for, wait_terminal
from tests.integration.test_tenants import as_key, darkroom, metric_samples

pytestmark = pytest.mark.integration
VOCABULARY = Vocabulary.shipped()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("expansion")
    yield from running(make_stack(tmp, postgres, models_dir, http=True, prompt_expander="model"))


def job(prompt: str, **fields: object) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(model="tiny", prompt=prompt, width=64, height=64, steps=3, seed=7, **fields)  # type: ignore[arg-type]


def added_phrases(prompt: str, expanded: str) -> list[str]:
    assert expanded.startswith(prompt + ", "), expanded
    return expanded[len(prompt) + 2 :].split(", ")


def test_an_expanded_prompt_is_stored_returned_and_what_the_sampler_used(stack: LocalStack, models_dir: Path) -> None:
    client = stub(stack)
    expanded = wait_terminal(client, client.SubmitJob(job("a lighthouse", expand_prompt=True)).job_id)
    assert expanded.status == pb.JOB_STATUS_SUCCEEDED, expanded.error
    assert expanded.prompt == "a lighthouse"
    phrases = added_phrases("a lighthouse", expanded.expanded_prompt)
    assert set(phrases) <= set(VOCABULARY.phrases) and words_of(", ".join(phrases)) <= VOCABULARY.words
    # Seeded: the gateway's expansion is the one this process makes of the same prompt and seed.
    here = ModelExpander(models_dir / "tiny-gpt2", VOCABULARY, max_tokens=24, max_phrases=6, top_k=8)
    assert here.expand("a lighthouse", 7) == expanded.expanded_prompt

    plain = wait_terminal(client, client.SubmitJob(job("a lighthouse")).job_id)
    as_text = wait_terminal(client, client.SubmitJob(job(expanded.expanded_prompt, expand_prompt=False)).job_id)
    assert plain.expanded_prompt == as_text.expanded_prompt == ""
    # The sampler encoded the expanded prompt: the same image as the expanded text
    # submitted as the prompt, another than the prompt alone.
    assert expanded.images[0].data == as_text.images[0].data
    assert expanded.images[0].data != plain.images[0].data
    listed = {j.job_id: j for j in client.ListJobs(pb.ListJobsRequest(page_size=50)).jobs}
    assert listed[expanded.job_id].expanded_prompt == expanded.expanded_prompt


def test_an_idempotent_resubmit_is_answered_with_the_job_as_stored(stack: LocalStack) -> None:
    client = stub(stack)
    first = client.SubmitJob(job("a harbour", expand_prompt=True, idempotency_key="expand-1"))
    stored = client.GetJob(pb.GetJobRequest(job_id=first.job_id)).expanded_prompt
    assert stored.startswith("a harbour, ")
    again = client.SubmitJob(job("a harbour", expand_prompt=True, idempotency_key="expand-1"))
    assert again.deduplicated and again.job_id == first.job_id
    assert client.GetJob(pb.GetJobRequest(job_id=first.job_id)).expanded_prompt == stored


def test_the_http_door_takes_expand_prompt_and_answers_revised_prompt(stack: LocalStack) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="open", timeout=120)
    made = sdk.images.generate(
        model="tiny", prompt="a fox", size="64x64", extra_body={"steps": 2, "seed": 11, "expand_prompt": True}
    )
    assert made.data and made.data[0].revised_prompt
    assert set(added_phrases("a fox", made.data[0].revised_prompt)) <= set(VOCABULARY.phrases)
    plain = sdk.images.generate(model="tiny", prompt="a fox", size="64x64", extra_body={"steps": 2, "seed": 11})
    assert plain.data and plain.data[0].revised_prompt is None
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.images.generate(model="tiny", prompt="a fox", size="64x64", extra_body={"expand_prompt": "yes"})
    assert refused.value.body["param"] == "expand_prompt"  # type: ignore[index]


def test_darkroom_generate_expand_prints_the_expanded_prompt(stack: LocalStack, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    args = ["generate", "a red fox", "--gateway", stack.gateway_address, "--model", "tiny", "-o", str(out)]
    args += ["--width", "64", "--height", "64", "--steps", "2", "--seed", "5", "--expand"]
    done = subprocess.run(
        [sys.executable, "-m", "services.ops.cli", *args], capture_output=True, text=True, timeout=120, check=True
    )
    [line] = [line for line in done.stdout.splitlines() if line.startswith("darkroom: expanded prompt: ")]
    expanded = line.removeprefix("darkroom: expanded prompt: ")
    assert set(added_phrases("a red fox", expanded)) <= set(VOCABULARY.phrases)
    assert out.stat().st_size > 0


def test_a_tenants_default_applies_where_the_request_says_nothing(stack: LocalStack) -> None:
    # Last in this module: a tenant made, the gateway wants keys from here on.
    darkroom(stack, "tenants", "create", "owls", "--lane", "free", "--expand-prompts")
    key = darkroom(stack, "keys", "create", "owls").stdout.strip().splitlines()[-1]
    client = stub(stack)

    def submitted(**fields: object) -> str:
        reply = client.SubmitJob(job("an owl", **fields), metadata=as_key(key))
        return client.GetJob(pb.GetJobRequest(job_id=reply.job_id), metadata=as_key(key)).expanded_prompt

    assert submitted().startswith("an owl, ")
    assert submitted(expand_prompt=False) == ""
    shown = darkroom(stack, "tenants", "update", "owls", "--no-expand-prompts").stdout
    assert "prompts expanded" not in shown
    # The gateway rereads a tenant's terms within a second.
    wait_for(submitted, lambda expanded: expanded == "", timeout=10, what="the tenant's new default")
    assert submitted(expand_prompt=True).startswith("an owl, ")


def expansions(stack: LocalStack) -> float:
    """Prompts the gateway has expanded."""
    return metric_samples(stack, "gateway").get(
        ("darkroom_prompt_expansion_seconds_count", (("expander", "model"),)), 0
    )


@pytest.mark.parametrize(
    ("tenant", "limits", "let_in"),
    [("larks", ("--rate", "0.001"), 1), ("terns", ("--credits", "0"), 0)],
)
def test_a_submit_its_tenant_s_limits_refuse_is_refused_before_its_prompt_is_expanded(
    stack: LocalStack, tenant: str, limits: tuple[str, str], let_in: int
) -> None:
    """The expansion thread is one for the gateway: a tenant past its rate or its
    credits no longer holds it for a job its limits then refuse."""
    darkroom(stack, "tenants", "create", tenant, "--lane", "free", *limits)
    key = darkroom(stack, "keys", "create", tenant).stdout.strip().splitlines()[-1]
    client = stub(stack)
    for _ in range(let_in):
        client.SubmitJob(job("a heron", expand_prompt=True), metadata=as_key(key))
    before = expansions(stack)
    with pytest.raises(grpc.RpcError) as refused:
        client.SubmitJob(job("a heron", expand_prompt=True), metadata=as_key(key))
    quota = quota_failure(refused.value)
    assert quota.violations[0].subject == f"tenant:{tenant}"
    assert expansions(stack) == before
    listed = client.ListJobs(pb.ListJobsRequest(page_size=10), metadata=as_key(key)).jobs
    assert len(listed) == let_in


# -- a gateway that expands nothing ----------------------------------------------------


@pytest.fixture
async def no_expansion(postgres: EmbeddedPostgres) -> AsyncIterator[image_generation_pb2_grpc.ImageGenerationStub]:
    url = migrated_database(postgres)
    repo = Repository(url, pool_size=1)
    settings = GatewaySettings(port=0, expansion=ExpansionSettings(prompt_expander="off"))
    server, servicer = create_server(KernelSettings(database_url=url), settings, repo, ModelRegistry.load())
    await server.grpc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield image_generation_pb2_grpc.ImageGenerationStub(ch)
    finally:
        await server.grpc.stop(0)
        await servicer.close()
        await repo.close()


async def test_a_gateway_with_expansion_off_refuses_to_expand_and_stores_nothing(
    no_expansion: image_generation_pb2_grpc.ImageGenerationStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await no_expansion.SubmitJob(job("a cat", expand_prompt=True))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(refused.value)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    assert [v.field for v in bad.field_violations] == ["expand_prompt"]
    assert not (await no_expansion.ListJobs(pb.ListJobsRequest())).jobs
    # Asking for none is no mistake.
    reply = await no_expansion.SubmitJob(job("a cat", expand_prompt=False))
    assert (await no_expansion.GetJob(pb.GetJobRequest(job_id=reply.job_id))).expanded_prompt == ""
