"""Text encoders served by the decoder service through the real stack: a registry
serving Flux.1's miniature twice from the same weights, once with its text encoders
on the sampler's device and once with ``text_encoders = "service"``. The served
model's job succeeds with a PNG, the same seed gives exactly the device entry's PNG,
and the decoder answered the encode (its /metrics counter), a second job of the same
prompt from its cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import metrics_text, png_size, stub, wait_terminal

pytestmark = pytest.mark.integration

FLUX = """
source = "builtin:tiny-flux"
family = "flux"
dtype = "float32"
vram_mb = 16
max_width = 512
max_height = 512
default_width = 64
default_height = 64
size_step = 16
max_steps = 100
max_images = 4
"""
REGISTRY = f'[models.tiny-flux]\ndefault = true\n{FLUX}\n[models.tiny-flux-served]\ntext_encoders = "service"\n{FLUX}'


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("served-encoders")
    registry = tmp / "registry.toml"
    registry.write_text(REGISTRY)
    yield from running(make_stack(tmp / "stack", postgres, models_dir, model_registry=str(registry)))


def prompt_encodes(stack: LocalStack, model: str, cached: str) -> float:
    """The decoder's count of EncodePrompt answers for ``model``, read from its /metrics."""
    [decoder] = [t for t in stack.metrics_targets() if t.service == "decoder"]
    for family in text_string_to_metric_families(metrics_text(decoder.address)):
        for sample in family.samples:
            if sample.name == "darkroom_decoder_prompt_encodes_total" and sample.labels == {
                "model": model,
                "cached": cached,
            }:
                return float(sample.value)
    return 0.0


def test_a_served_models_job_gives_the_device_entrys_png_and_the_decoder_encoded_it(stack: LocalStack) -> None:
    client = stub(stack)

    def ask(model: str) -> pb.SubmitJobRequest:
        return pb.SubmitJobRequest(
            model=model, prompt="a lighthouse", width=80, height=64, steps=4, seed=7, guidance_scale=3.5
        )

    served = wait_terminal(client, client.SubmitJob(ask("tiny-flux-served")).job_id)
    assert served.status == pb.JOB_STATUS_SUCCEEDED, served.error
    [image] = served.images
    assert png_size(image.data) == (80, 64)
    assert prompt_encodes(stack, "tiny-flux-served", "false") == 1
    on_device = wait_terminal(client, client.SubmitJob(ask("tiny-flux")).job_id)
    assert on_device.status == pb.JOB_STATUS_SUCCEEDED, on_device.error
    assert on_device.images[0].data == image.data, "the same seed gives the device entry's image"
    again = wait_terminal(client, client.SubmitJob(ask("tiny-flux-served")).job_id)
    assert again.images[0].data == image.data
    # The same prompt again: the decoder's cache answered, no encoder ran.
    assert prompt_encodes(stack, "tiny-flux-served", "false") == 1
    assert prompt_encodes(stack, "tiny-flux-served", "true") == 1
