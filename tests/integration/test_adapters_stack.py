"""LoRA adapters from push to image through a running stack and a real model store
(seaweedfs): a job names an adapter of the store and gets another image than
without it, the same one each time; jobs with other adapters run beside it; a name
without a version gets the latest, which the job keeps; the new families (SD 3.5,
Flux.1, Qwen-Image, Z-Image) take theirs too; unknown adapters, adapters of another
family and too many are refused naming the field before anything is stored; and the
same through the OpenAI door (``extra_body``) and ``darkroom generate --lora``."""

from __future__ import annotations

import base64
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from services.models.adapters.pushing import push_adapter
from services.models.registry import ModelRegistry
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import count_jobs, png_size, store_values, stub, wait_terminal
from tests.integration.test_host_cache import object_store
from tests.integration.test_http_api_retries import sdk
from tests.integration.test_invalid_requests import violations
from tests.lora_files import attention_layers, write_diffusers_lora, write_kohya_lora

pytestmark = pytest.mark.integration

# The miniatures of the new families, each taking adapters in the stack's registry.
FLOW_MODELS = ("tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-z-image")


def registry_text() -> str:
    """The default registry, the new families' miniatures given adapter slots."""
    text = (Path(__file__).parents[2] / "services/models/default_registry.toml").read_text()
    for model in FLOW_MODELS:
        text = text.replace(f"[models.{model}]\n", f"[models.{model}]\nadapter_slots = 2\nadapter_rank = 4\n", 1)
    return text


@pytest.fixture(scope="module")
def adapters(model_store: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Adapters pushed for the miniature, under names of their own (the store is the session's)."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet")
    root = tmp_path_factory.mktemp("adapters")
    tiny = ModelRegistry.load().get("tiny")
    tag = uuid.uuid4().hex[:6]
    names = {"style": f"style-{tag}", "subject": f"subject-{tag}", "flux": f"flux-{tag}"}
    store = object_store(model_store)
    push_adapter(
        store,
        write_kohya_lora(root / "s", unet, attention_layers(unet), seed=11),
        names["style"] + ":v1",
        tiny,
        models_dir,
    )
    subject = write_diffusers_lora(root / "t", unet, attention_layers(unet), rank=8, seed=12)
    push_adapter(store, subject, names["subject"] + ":v1", tiny, models_dir)
    # One for each new family (Flux.1's also what the gateway refuses for the miniature).
    from diffusers import DiffusionPipeline

    registry_file = root / "registry.toml"
    registry_file.write_text(registry_text())
    registry = ModelRegistry.load(registry_file)
    for model in FLOW_MODELS:
        transformer: Any = DiffusionPipeline.from_pretrained(models_dir / model).transformer
        directory = write_diffusers_lora(
            root / model, transformer, attention_layers(transformer), rank=4, seed=13, prefix="transformer"
        )
        name = "flux" if model == "tiny-flux" else model
        names[name] = names.get(name, f"{model}-{tag}")
        push_adapter(store, directory, names[name] + ":v1", registry.get(model), models_dir)
    names["registry"] = str(registry_file)
    return names


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    postgres: EmbeddedPostgres,
    models_dir: Path,
    model_store: Any,
    adapters: dict[str, str],
) -> Iterator[LocalStack]:
    yield from running(
        make_stack(
            tmp_path_factory.mktemp("adapters-stack"),
            postgres,
            models_dir,
            http=True,
            model_registry=adapters["registry"],
            **store_values(model_store),  # each role its own identity, as `darkroom up --model-store` gives them
        )
    )


def submit(stack: LocalStack, *adapters: pb.Adapter, seed: int = 7, model: str = "tiny") -> pb.Job:
    client = stub(stack)
    request = pb.SubmitJobRequest(model=model, prompt="a lighthouse", steps=3, seed=seed, adapters=adapters)
    job = wait_terminal(client, client.SubmitJob(request).job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    return job


def image_of(job: pb.Job) -> bytes:
    [image] = job.images
    assert image.data
    return bytes(image.data)


def test_a_job_with_an_adapter_gets_its_own_image_every_time(stack: LocalStack, adapters: dict[str, str]) -> None:
    plain = submit(stack)
    styled = submit(stack, pb.Adapter(name=adapters["style"], scale=1.5))
    again = submit(stack, pb.Adapter(name=adapters["style"] + ":v1", scale=1.5))
    both = submit(stack, pb.Adapter(name=adapters["subject"]), pb.Adapter(name=adapters["style"], scale=0.5))
    # The name alone got the latest version, which the job keeps; the scale as asked.
    assert [(a.name, a.scale) for a in styled.adapters] == [(adapters["style"] + ":v1", 1.5)]
    assert [a.name for a in both.adapters] == [adapters["subject"] + ":v1", adapters["style"] + ":v1"]
    images = [image_of(job) for job in (plain, styled, again, both)]
    assert images[1] == images[2]
    assert len({images[0], images[1], images[3]}) == 3


@pytest.mark.parametrize("model", FLOW_MODELS)
def test_the_new_families_take_adapters_through_the_stack(
    stack: LocalStack, adapters: dict[str, str], model: str
) -> None:
    name = adapters["flux" if model == "tiny-flux" else model]
    plain = image_of(submit(stack, model=model))
    adapted = submit(stack, pb.Adapter(name=name), model=model)
    assert [a.name for a in adapted.adapters] == [name + ":v1"]
    assert image_of(adapted) != plain


def test_adapters_that_cannot_apply_are_refused_by_field_and_nothing_is_stored(
    stack: LocalStack, adapters: dict[str, str]
) -> None:
    client = stub(stack)
    before = count_jobs(stack)
    five = [pb.Adapter(name=f"a{i}") for i in range(5)]
    for given, field in (
        ([pb.Adapter(name="no-such-adapter")], "adapters[0].name"),
        ([pb.Adapter(name=adapters["style"]), pb.Adapter(name=adapters["flux"])], "adapters[1].name"),
        ([pb.Adapter(name=adapters["style"] + ":v9")], "adapters[0].name"),
        ([pb.Adapter(name=adapters["style"], scale=float("nan"))], "adapters[0].scale"),
        ([pb.Adapter(name=adapters["style"]), pb.Adapter(name=adapters["style"])], "adapters[1].name"),
        (five, "adapters"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="x", adapters=given))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in violations(refused.value), refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="x", adapters=[pb.Adapter(name=adapters["flux"])]))
    assert "adapts flux models; 'tiny' is a tiny model" in (refused.value.details() or "")
    assert count_jobs(stack) == before


def test_the_openai_door_and_the_cli_take_adapters(stack: LocalStack, adapters: dict[str, str], tmp_path: Path) -> None:
    client = sdk(stack)
    made = client.images.generate(
        model="tiny",
        prompt="a lighthouse",
        size="64x64",
        extra_body={"steps": 2, "adapters": [{"name": adapters["style"], "scale": 0.8}]},
    )
    assert made.data is not None and png_size(base64.b64decode(made.data[0].b64_json or "")) == (64, 64)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model="tiny", prompt="x", extra_body={"adapters": [{"name": "no-such-adapter"}]})
    assert "adapters[0].name" in str(refused.value)
    out = tmp_path / "styled.png"
    command = [
        sys.executable,
        "-m",
        "services.ops.cli",
        "generate",
        "a cat",
        "-o",
        str(out),
        "--gateway",
        stack.gateway_address,
    ]
    result = subprocess.run(
        [*command, "--width", "64", "--height", "64", "--steps", "2", "--lora", adapters["style"] + ":v1:0.8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert png_size(out.read_bytes()) == (64, 64)
