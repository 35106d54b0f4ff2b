"""A job of each flow-matching transformer family (SD 3.5, Flux.1 dev and schnell,
Qwen-Image, Z-Image-Turbo) through the real stack, with its miniature: placed, sampled,
its previews streamed, decoded by the decoder service's 16-channel VAE (Qwen-Image's a
3D one, through its frame axis), and the PNG of its size returned;
the same seed gives the same image; a size its patches cannot take is refused by
name before anything is stored; a guided Z-Image job (a negative prompt) returns
its PNG too. An instruction edit (Flux.1 Kontext, Qwen-Image-Edit): an
image and a sentence give an image of the input's size; one without an image, or with a mask or a
strength, is refused by name. SD 3.5, Flux.1, Qwen-Image and Z-Image edit an input
image (image to image, inpainting) through the same path as SD 1.5."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import png_size, stub, wait_terminal
from tests.integration.test_http_api import png

pytestmark = pytest.mark.integration

MODELS = ["tiny-sd3", "tiny-flux", "tiny-flux-schnell", "tiny-qwen-image", "tiny-z-image"]


@pytest.mark.parametrize("model", MODELS)
def test_a_job_streams_its_previews_and_returns_a_png_of_its_size(stack, model: str) -> None:
    client = stub(stack)
    # Enough steps that the stream is following before the preview is taken.
    # The paid lane's outputs leave as made ("flag"): its jobs may have previews.
    request = pb.SubmitJobRequest(
        model=model, prompt="a lighthouse", width=96, height=64, steps=40, seed=3, previews=1, lane="paid"
    )
    job_id = client.SubmitJob(request).job_id
    events = list(client.StreamJob(pb.StreamJobRequest(job_id=job_id), timeout=120))
    terminal = events[-1].terminal
    assert terminal.status == pb.JOB_STATUS_SUCCEEDED, terminal.error
    assert [e.preview.step for e in events if e.HasField("preview")] == [20]
    job = wait_terminal(client, job_id)
    [image] = job.images
    assert (image.width, image.height) == (96, 64) and png_size(image.data) == (96, 64)
    again = wait_terminal(client, client.SubmitJob(request).job_id)
    assert again.images[0].data == image.data, "the same seed gives the same image"


def test_a_guided_z_image_job_returns_a_png_of_its_size(stack) -> None:
    client = stub(stack)
    request = pb.SubmitJobRequest(
        model="tiny-z-image",
        prompt="a lighthouse",
        negative_prompt="fog",
        guidance_scale=4.0,
        width=64,
        height=96,
        steps=4,
        seed=5,
    )
    job = wait_terminal(client, client.SubmitJob(request).job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    [image] = job.images
    assert png_size(image.data) == (64, 96)
    turbo = pb.SubmitJobRequest()
    turbo.CopyFrom(request)
    turbo.guidance_scale = 0.0
    other = wait_terminal(client, client.SubmitJob(turbo).job_id)
    assert other.images[0].data != image.data, "guidance reaches the network"


def test_a_size_the_patches_cannot_take_is_refused_by_name(stack) -> None:
    client = stub(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.SubmitJob(pb.SubmitJobRequest(model="tiny-flux", prompt="a lighthouse", width=72, height=64, steps=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "width" in (err.value.details() or "")


@pytest.mark.parametrize("model", ["tiny-flux-kontext", "tiny-qwen-image-edit"])
def test_an_instruction_edit_makes_an_image_of_its_inputs_size(stack, model: str) -> None:
    client = stub(stack)
    request = pb.SubmitJobRequest(
        model=model, prompt="make it night", image=png((96, 64), (200, 30, 60)), steps=3, seed=4
    )
    job = wait_terminal(client, client.SubmitJob(request).job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    [image] = job.images
    assert png_size(image.data) == (96, 64)
    dark = pb.SubmitJobRequest()
    dark.CopyFrom(request)
    dark.image = png((96, 64), (0, 0, 0))
    other = wait_terminal(client, client.SubmitJob(dark).job_id)
    assert other.images[0].data != image.data, "the input image reaches the network"


@pytest.mark.parametrize(
    ("extra", "field"),
    [({}, "image"), ({"mask": png((64, 64), 255, "L")}, "mask"), ({"strength": 0.5}, "strength")],
    ids=["no image", "a mask", "a strength"],
)
def test_an_instruction_edit_refuses_what_it_cannot_use_by_name(stack, extra: dict[str, Any], field: str) -> None:
    request = pb.SubmitJobRequest(model="tiny-flux-kontext", prompt="make it night", steps=2, **extra)
    if field != "image":
        request.image = png((64, 64), (200, 30, 60))
    with pytest.raises(grpc.RpcError) as err:
        stub(stack).SubmitJob(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(f"{field}:"), err.value.details()


@pytest.mark.parametrize(
    ("model", "masked"),
    [("tiny-sd3", False), ("tiny-flux", True), ("tiny-qwen-image", True), ("tiny-z-image", False)],
    ids=["sd3 image to image", "flux inpainting", "qwen-image inpainting", "z-image image to image"],
)
def test_an_edit_of_an_input_image_makes_an_image_of_its_size(stack, model: str, masked: bool) -> None:
    client = stub(stack)
    request = pb.SubmitJobRequest(model=model, prompt="a door", image=png((80, 64), (20, 120, 200)), steps=4, seed=2)
    if masked:
        request.mask = png((80, 64), 255, "L")
    else:
        request.strength = 0.6
    job = wait_terminal(client, client.SubmitJob(request).job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert png_size(job.images[0].data) == (80, 64)
