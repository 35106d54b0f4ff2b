"""A job of each flow-matching transformer family (SD 3.5, Flux.1 dev and schnell)
through the real stack, with its miniature: placed, sampled, its previews streamed,
decoded by the decoder service's 16-channel VAE, and the PNG of its size returned;
the same seed gives the same image; a size its patches cannot take is refused by
name before anything is stored."""

from __future__ import annotations

import grpc
import pytest

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.helpers import png_size, stub, wait_terminal

pytestmark = pytest.mark.integration

MODELS = ["tiny-sd3", "tiny-flux", "tiny-flux-schnell"]


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


def test_a_size_the_patches_cannot_take_is_refused_by_name(stack) -> None:
    client = stub(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.SubmitJob(pb.SubmitJobRequest(model="tiny-flux", prompt="a lighthouse", width=72, height=64, steps=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "width" in (err.value.details() or "")
