"""The OpenAI-compatible HTTP API, with the official `openai` SDK as the client (its
default retries on, as its users have them), on a real stack: generations inline
and as signed links (refused once expired or tampered with), edits with an image
and a mask, streamed generations and edits under OpenAI's event names, videos
created, listed, downloaded and deleted, the models list, a job left running and
followed, the fleet, a stream's error naming its job, and each refusal raised as
the SDK's own exception: a bad parameter named, a bad key, another tenant's job, a
spent quota.
And the page, in a real headless Chromium (Debian's `chromium`, driven by
Playwright): a prompt submitted, its progress bar moving, its image appearing; the
fleet view showing each running sampler."""

from __future__ import annotations

import base64
import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Image as OpenAiImage
from openai.types import (
    ImageEditCompletedEvent,
    ImageEditPartialImageEvent,
    ImageGenCompletedEvent,
    ImageGenPartialImageEvent,
    ImagesResponse,
)
from PIL import Image
from pydantic import BaseModel

from http_api.signed_urls import UrlSigner, load_key
from services.models.video_encoding import probe_video
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import png_size, stub, wait_for
from tests.integration.test_tenants import darkroom
from tests.needs import require

pytestmark = pytest.mark.integration

SMALL = {"steps": 2, "seed": 7}
# A lane whose outputs leave as made (policy "flag"): the free lane, where an open
# stack's jobs run, blocks flagged outputs, and its jobs get no previews.
PREVIEWED = {"lane": "paid"}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As the machines here need it: no sandbox as root, no GPU, and nothing reaching out.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    yield from running(make_stack(tmp_path_factory.mktemp("http"), postgres, models_dir, http=True))


def client(stack: LocalStack, key: str = "anything: the gateway is open") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=key, timeout=120)


def outputs(response: ImagesResponse) -> list[OpenAiImage]:
    assert response.data is not None
    return response.data


def extra(model: BaseModel) -> dict[str, Any]:
    """What Darkroom adds to an OpenAI object."""
    assert model.model_extra is not None
    return model.model_extra


def png(size: tuple[int, int], colour: int | tuple[int, int, int], mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, format="PNG")
    return out.getvalue()


def test_a_generation_comes_inline_or_as_a_signed_link(stack: LocalStack) -> None:
    sdk = client(stack)
    inline = sdk.images.generate(model="tiny", prompt="a lighthouse", size="64x64", extra_body=SMALL)
    [image] = outputs(inline)
    assert image.b64_json and png_size(base64.b64decode(image.b64_json)) == (64, 64)
    assert inline.size == "64x64" and inline.output_format == "png"
    assert inline.usage is not None and extra(inline.usage)["gpu_seconds"] > 0

    linked = sdk.images.generate(
        prompt="a lighthouse", size="64x64", response_format="url", output_format="webp", n=2, extra_body=SMALL
    )
    urls = [d.url or "" for d in outputs(linked)]
    assert len(urls) == 2 and all(u.startswith(stack.http_url + "/v1/files/") for u in urls)
    fetched = httpx.get(urls[0])
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)

    tampered = urls[0].replace("signature=", "signature=0")
    assert httpx.get(tampered).status_code == 403
    job_id = urls[0].split("/v1/files/")[1].split("/")[0]
    key = load_key(stack.settings.http.url_key_file)
    expired = UrlSigner(key, ttl_s=60).path(job_id, 0, now=time.time() - 120)
    refused = httpx.get(stack.http_url + expired)
    assert refused.status_code == 403 and "expired" in refused.json()["error"]["message"]
    assert httpx.get(stack.http_url + UrlSigner(key, ttl_s=60).path(job_id, 0, now=time.time())).status_code == 200


def test_an_edit_takes_an_image_and_a_mask(stack: LocalStack) -> None:
    sdk = client(stack)
    source, mask = png((96, 64), (200, 30, 60)), png((96, 64), 255, "L")
    edited = sdk.images.edit(
        model="tiny", image=("in.png", source), mask=("mask.png", mask), prompt="at night", extra_body=SMALL
    )
    assert png_size(base64.b64decode(outputs(edited)[0].b64_json or "")) == (96, 64)
    other = sdk.images.edit(
        image=("in.png", png((96, 64), (10, 200, 60))), prompt="at night", extra_body={**SMALL, "strength": 0.5}
    )
    assert outputs(other)[0].b64_json != outputs(edited)[0].b64_json


def test_the_models_are_listed_defaults_first(stack: LocalStack) -> None:
    models = client(stack).models.list().data
    assert models[0].id == "tiny" and extra(models[0])["default"] is True
    assert {m.id for m in models} >= {"tiny", "tiny-wan", "tiny-upscaler"}


def test_a_job_left_running_is_followed_to_its_links(stack: LocalStack) -> None:
    posted = httpx.post(
        f"{stack.http_url}/v1/images/generations",
        json={"model": "tiny", "prompt": "a fox", "size": "64x64", **SMALL},
        headers={"Prefer": "respond-async"},
    )
    assert posted.status_code == 202, posted.text
    job = posted.json()
    assert job["object"] == "darkroom.job" and job["url"].endswith(f"/v1/jobs/{job['id']}")
    done = wait_for(
        lambda: httpx.get(job["url"]).json(), lambda j: j["status"] == "succeeded", timeout=60, what="the job"
    )
    assert done["progress"] == {"step": 2, "total": 2} and done["usage"]["gpu_seconds"] > 0
    [link] = done["data"]
    assert png_size(httpx.get(link["url"]).content) == (64, 64)


def test_a_job_s_events_carry_its_steps_then_its_end(stack: LocalStack) -> None:
    posted = httpx.post(
        f"{stack.http_url}/v1/images/generations",
        json={"model": "tiny", "prompt": "a fox", "size": "64x64", "steps": 6},
        headers={"Prefer": "respond-async"},
    ).json()
    with httpx.stream("GET", f"{stack.http_url}/v1/jobs/{posted['id']}/events", timeout=60) as response:
        assert response.headers["content-type"] == "text/event-stream"
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data:")]
    # Each step once and in order, from whenever the stream joined (the job may start first).
    steps = [e["step"] for e in events if e["type"] == "darkroom.job.progress"]
    assert steps == sorted(set(steps)) and set(steps) <= set(range(1, 7)), events
    [done] = [e for e in events if e["type"] == "darkroom.job.done"]
    assert events[-1] is done and done["job"]["status"] == "succeeded"
    assert png_size(httpx.get(done["job"]["data"][0]["url"]).content) == (64, 64)
    missing = httpx.get(f"{stack.http_url}/v1/jobs/00000000-0000-0000-0000-000000000000/events")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"size": "64by64"}, "size"),
        ({"size": "60x64"}, "size"),
        ({"n": 50}, "n"),
        ({"n": 5}, "n"),
        ({"n": "two"}, "n"),
        ({"colour": "blue"}, "colour"),
        ({"steps": 1.5}, "steps"),
        ({"response_format": "gif"}, "response_format"),
        ({"model": "sd3"}, "model"),
        ({"partial_images": 5}, "partial_images"),
    ],
)
def test_a_bad_parameter_is_a_bad_request_naming_it(stack: LocalStack, fields: dict, param: str) -> None:
    jobs = stub(stack)
    before = [j.job_id for j in jobs.ListJobs(pb.ListJobsRequest(page_size=200)).jobs]
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack).images.generate(prompt="x", extra_body={"model": "tiny", "size": "64x64", **SMALL, **fields})
    assert refused.value.status_code == 400 and refused.value.body["param"] == param, refused.value.body  # type: ignore[index]
    assert [j.job_id for j in jobs.ListJobs(pb.ListJobsRequest(page_size=200)).jobs] == before, "nothing stored"


def test_a_malformed_or_oversized_body_is_refused(stack: LocalStack) -> None:
    assert (
        httpx.post(f"{stack.http_url}/v1/images/generations", content=b"{not json").json()["error"]["param"] == "body"
    )
    form = httpx.post(f"{stack.http_url}/v1/images/edits", data={"prompt": "x"}, files={"mask": ("m.png", b"12")})
    assert form.status_code == 400 and form.json()["error"]["param"] == "image"
    huge = httpx.post(
        f"{stack.http_url}/v1/images/edits", files={"image": ("i.png", b"0" * (60 * 2**20))}, data={"prompt": "x"}
    )
    assert huge.status_code == 413
    # Within the body's limit, an image over the gateway's (DARKROOM_MAX_INPUT_MB) is named.
    over = httpx.post(
        f"{stack.http_url}/v1/images/edits",
        files={"image": ("i.png", b"0" * (17 * 2**20))},
        data={"prompt": "x", "model": "tiny"},
    )
    assert over.status_code == 400 and over.json()["error"]["param"] == "image", over.text


def test_a_video_is_created_retrieved_and_downloaded(stack: LocalStack) -> None:
    sdk = client(stack)
    created = sdk.videos.create(prompt="waves", seconds="4", extra_body={"size": "64x48", "steps": 2, "fps": 2})
    assert created.object == "video" and created.status in ("queued", "in_progress")
    done = wait_for(
        lambda: sdk.videos.retrieve(created.id), lambda v: v.status == "completed", timeout=60, what="the video"
    )
    assert done.progress == 100 and done.size == "64x48" and done.seconds == "4"
    clip = sdk.videos.download_content(created.id).content
    info = probe_video(clip)
    assert (info.mime_type, info.frames, info.width, info.height, info.fps) == ("video/mp4", 9, 64, 48, 2.0)
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.videos.create(prompt="waves", seconds="12")
    assert too_long.value.body["param"] == "seconds"  # type: ignore[index]
    image_job = httpx.post(
        f"{stack.http_url}/v1/images/generations",
        json={"prompt": "x", "size": "64x64", **SMALL},
        headers={"Prefer": "respond-async"},
    ).json()["id"]
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(image_job)


def test_the_fleet_and_the_recent_jobs(stack: LocalStack) -> None:
    fleet = httpx.get(f"{stack.http_url}/v1/fleet").json()
    samplers = [w for w in fleet["workers"] if w["kind"] == "sampler"]
    assert [w["id"] for w in samplers] == stack.sampler_ids()
    assert samplers[0]["state"] == "ready" and "image" in samplers[0]["capabilities"]
    assert fleet["usage"]["tenant"] == "default"
    recent = httpx.get(f"{stack.http_url}/v1/jobs", params={"limit": 3}).json()["data"]
    assert len(recent) == 3 and recent == sorted(recent, key=lambda j: -j["created"])
    done = [j for j in recent if j["status"] == "succeeded"]
    assert done and all(j["stages"]["total"] > 0 and j["worker_id"] for j in done)
    assert httpx.get(f"{stack.http_url}/v1/jobs", params={"limit": 0}).json()["error"]["param"] == "limit"


def test_a_streamed_generation_sends_partial_images_then_the_image(stack: LocalStack) -> None:
    stream = client(stack).images.generate(
        model="tiny",
        prompt="a fox",
        size="64x64",
        stream=True,
        partial_images=2,
        extra_body={"steps": 30, "seed": 3, **PREVIEWED},
    )
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    for index, partial in enumerate(events[:2]):
        assert isinstance(partial, ImageGenPartialImageEvent) and partial.partial_image_index == index
        with Image.open(io.BytesIO(base64.b64decode(partial.b64_json))) as preview:
            assert (preview.format, preview.size) == ("JPEG", (64, 64))
    final = events[-1]
    assert isinstance(final, ImageGenCompletedEvent)
    assert png_size(base64.b64decode(final.b64_json)) == (64, 64) and extra(final.usage)["gpu_seconds"] > 0
    with pytest.raises(openai.BadRequestError) as several:
        list(client(stack).images.generate(prompt="x", n=2, stream=True, extra_body={"model": "tiny", **SMALL}))
    assert several.value.body["param"] == "n"  # type: ignore[index]


def test_a_streamed_edit_sends_image_edit_events(stack: LocalStack) -> None:
    stream = client(stack).images.edit(
        model="tiny",
        image=("in.png", png((64, 64), (200, 30, 60))),
        prompt="at night",
        stream=True,
        partial_images=1,
        extra_body={"steps": 30, "seed": 3, "strength": 1.0, **PREVIEWED},
    )
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert isinstance(events[0], ImageEditPartialImageEvent) and events[0].partial_image_index == 0
    final = events[-1]
    assert isinstance(final, ImageEditCompletedEvent) and png_size(base64.b64decode(final.b64_json)) == (64, 64)


def newest_job(stack: LocalStack, prompt: str) -> pb.Job:
    """The newest job with ``prompt``, once it is stored."""
    return wait_for(
        lambda: [j for j in stub(stack).ListJobs(pb.ListJobsRequest(page_size=20)).jobs if j.prompt == prompt],
        bool,
        timeout=30,
        what=f"a job of {prompt!r}",
    )[0]


def test_a_stream_s_error_names_its_job_and_param(stack: LocalStack) -> None:
    prompt = "a fox, cancelled mid-stream"
    stream = client(stack).images.generate(
        model="tiny", prompt=prompt, size="512x512", stream=True, extra_body={"steps": 100, "seed": 3}
    )
    job = newest_job(stack, prompt)
    stub(stack).CancelJob(pb.CancelJobRequest(job_id=job.job_id))
    with pytest.raises(openai.APIError) as broken:
        list(stream)
    error = broken.value.body
    assert isinstance(error, dict), error
    assert error["code"] == "job_cancelled" and error["job_id"] == job.job_id
    assert "param" in error and error["param"] is None and error["type"] == "server_error"


def test_videos_are_listed_newest_first_and_deleted(stack: LocalStack) -> None:
    sdk = client(stack)
    made = sdk.videos.create(prompt="a short one", extra_body={"size": "64x48", "steps": 2, "frames": 5})
    wait_for(lambda: sdk.videos.retrieve(made.id), lambda v: v.status == "completed", timeout=60, what="the video")
    long = sdk.videos.create(prompt="a long one", extra_body={"size": "128x128", "steps": 50, "frames": 33})
    an_image = httpx.post(
        f"{stack.http_url}/v1/images/generations",
        json={"prompt": "not a video", "size": "64x64", **SMALL},
        headers={"Prefer": "respond-async"},
    ).json()["id"]

    gone = sdk.videos.delete(long.id)
    assert (gone.id, gone.object, gone.deleted) == (long.id, "video.deleted", True)
    cancelled = wait_for(lambda: sdk.videos.retrieve(long.id), lambda v: v.status == "failed", timeout=30, what="it")
    assert cancelled.error is not None and cancelled.error.code == "job_status_cancelled"
    # A video already made stays stored: not deleted.
    kept = sdk.videos.delete(made.id)
    assert kept.deleted is False and sdk.videos.download_content(made.id).content

    one_a_page = [v.id for v in sdk.videos.list(limit=1)]  # each page's last_id is the next page's after
    assert one_a_page[:2] == [long.id, made.id] and an_image not in one_a_page
    assert len(one_a_page) == len(set(one_a_page))
    oldest_first = [v.id for v in sdk.videos.list(order="asc", limit=100)]
    assert oldest_first == one_a_page[::-1]
    with pytest.raises(openai.NotFoundError):
        sdk.videos.delete(an_image)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.videos.list(after="no-such-video")
    assert bad.value.body["param"] == "after"  # type: ignore[index]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    require("" if Path(CHROMIUM).exists() else "Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield launched
        launched.close()


def test_a_prompt_shows_its_progress_then_its_image(stack: LocalStack, browser) -> None:  # type: ignore[no-untyped-def]
    page = browser.new_page()
    page.goto(stack.http_url + "/")
    # Every value the progress bar takes, recorded by the page itself.
    page.evaluate(
        """() => {
            window.progressSeen = [];
            const bar = document.getElementById("progress");
            new MutationObserver(() => window.progressSeen.push(Number(bar.value)))
                .observe(bar, { attributes: true, attributeFilter: ["value"] });
            const set = Object.getOwnPropertyDescriptor(HTMLProgressElement.prototype, "value").set;
            Object.defineProperty(bar, "value", {
                set(v) { set.call(this, v); window.progressSeen.push(Number(v)); },
                get() { return Number(this.getAttribute("value")); },
            });
        }"""
    )
    page.fill("#prompt", "a fox in the snow")
    page.fill("#size", "64x64")
    page.fill("#steps", "30")
    page.click("#generate")
    image = page.wait_for_selector("#result img", timeout=60_000)
    assert image is not None
    page.wait_for_function("() => document.querySelector('#result img').naturalWidth > 0", timeout=30_000)
    assert page.evaluate("() => document.querySelector('#result img').naturalWidth") == 64
    seen = page.evaluate("() => window.progressSeen")
    moving = [v for v in seen if 0 < v < 1]
    assert moving, f"the bar never stood between empty and full: {seen}"
    assert seen == sorted(seen), seen
    assert page.text_content("#status") == "succeeded 30/30"


def test_the_fleet_view_shows_each_running_sampler(stack: LocalStack, browser) -> None:  # type: ignore[no-untyped-def]
    page = browser.new_page()
    page.goto(stack.http_url + "/")
    for sampler in stack.sampler_ids():
        row = page.wait_for_selector(f"#workers tr[data-worker='{sampler}']", timeout=15_000)
        assert row is not None and "ready" in (row.text_content() or "")
    page.wait_for_selector("#jobs tr", timeout=15_000)


def test_refusals_are_the_sdks_own_exceptions(stack: LocalStack) -> None:
    """Last in this module: it closes the gateway by making tenants."""
    open_job = httpx.post(
        f"{stack.http_url}/v1/images/generations",
        json={"model": "tiny", "prompt": "before", "size": "64x64", **SMALL},
        headers={"Prefer": "respond-async"},
    ).json()["id"]
    darkroom(stack, "tenants", "create", "cats", "--lane", "free", "--credits", "0")
    darkroom(stack, "tenants", "create", "dogs", "--lane", "paid")
    cats = darkroom(stack, "keys", "create", "cats").stdout.strip().splitlines()[-1]
    dogs = darkroom(stack, "keys", "create", "dogs").stdout.strip().splitlines()[-1]

    def refused_with_bad_key() -> bool:
        try:
            client(stack, "drk_nobody_0000").models.list()
        except openai.AuthenticationError:
            return True
        return False

    assert wait_for(refused_with_bad_key, bool, timeout=10, what="the gateway closed")
    with pytest.raises(openai.RateLimitError) as spent:
        client(stack, cats).images.generate(model="tiny", prompt="x", size="64x64", extra_body=SMALL)
    assert spent.value.body["code"] == "insufficient_quota"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client(stack, dogs).get(f"/jobs/{open_job}", cast_to=object)
    with pytest.raises(openai.PermissionDeniedError):
        client(stack, cats).images.generate(
            model="tiny", prompt="x", size="64x64", extra_body={**SMALL, "lane": "paid"}
        )
