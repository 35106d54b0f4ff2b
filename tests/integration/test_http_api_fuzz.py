"""The HTTP API against bad input, large bodies and strangers, on a real stack.

Input that used to be a plain-text 500 (and a retry from the SDK, and a traceback
in the log) is a 400 in OpenAI's shape naming its parameter, and stores nothing.
A body over its route's limit is refused before it is read; once tenants exist, a
request without a key (or with one the gateway does not know) is refused before
its body is read. And hypothesis throws bodies, headers, query strings, paths and
signed links at every route, as the gRPC gateway's fuzz does at SubmitJob: never a
500, every error in OpenAI's shape, and the process as it was after (the same
pid, serving, no traceback in its log, its memory bounded)."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from http_api.limits import JSON_BODY_BYTES, upload_bytes
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import count_jobs, stub, wait_for
from tests.integration.test_tenants import darkroom

pytestmark = pytest.mark.integration

# 400 examples a route (the gRPC fuzz runs 300): derandomized, every run sends the
# same ones; 1,000 cost the suite about a minute more of its two cores.
FUZZ = settings(
    max_examples=400,
    derandomize=True,  # the same run each time
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# How much the HTTP process may grow over a module of requests (its pod's limit is 1 GiB).
MEMORY_SLACK = 200 * 2**20
# OpenAI's parameters and Darkroom's, which a body names.
PARAMETERS = (
    "prompt model n size response_format output_format seed steps negative_prompt guidance lane stream "
    "partial_images strength quality style background moderation output_compression user seconds frames fps "
    "input_reference"
).split()
# Values no JSON encoder writes for us: an integer of 5,000 digits, a lone surrogate.
HUGE, SURROGATE = "<<huge>>", "<<surrogate>>"
NASTY_TEXT = [
    "",
    " ",
    "²",
    "6²x64",
    "64x64",
    "\u0666\u0664x64",
    "99999999999999999999x1",
    "auto",
    "nan",
    "inf",
    "-1",
    "1e400",
    "\x00",
    "a\x00b",
    "é" * 3,
    "png",
    "url",
    "tiny",
    "tiny-wan",
    "9" * 5000,
    HUGE,
    SURROGATE,
]
TEXT = st.text(max_size=30) | st.sampled_from(NASTY_TEXT)
SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
)
VALUE = st.recursive(
    SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6
)
BODY = st.dictionaries(st.sampled_from(PARAMETERS) | TEXT, VALUE, max_size=7)
# Bodies near a valid one, to reach the gateway: small jobs (steps 1..3), each field sometimes odd.
NEAR_VALID = st.fixed_dictionaries(
    {
        "prompt": st.sampled_from(["a fox", "waves"]) | TEXT,
        "steps": st.integers(1, 3),
        "size": st.sampled_from(["64x64", "64x48", "auto", "512x512", "65x64", "16x16", "4096x4096"]) | TEXT,
    },
    optional={
        "model": st.sampled_from(["tiny", "tiny-wan", "tiny-upscaler", "nope", ""]) | TEXT,
        "n": st.integers(-1, 5) | VALUE,
        "seed": st.integers(-1, 2**64) | VALUE,
        "guidance": st.floats() | VALUE,
        "strength": st.floats() | VALUE,
        "negative_prompt": TEXT,
        "lane": st.sampled_from(["", "free", "paid", "batch", "realtime", "nope"]) | TEXT,
        "output_format": st.sampled_from(["png", "jpeg", "webp", "mp4", "gif", ""]) | TEXT,
        "response_format": st.sampled_from(["url", "b64_json", ""]) | TEXT,
        "stream": st.booleans() | VALUE,
        "partial_images": st.integers(-1, 4),
        "frames": st.integers(-1, 40) | VALUE,
        "fps": st.floats(-1, 200) | VALUE,
        "seconds": st.sampled_from(["1", "4", "0", "-1", "1e9", "²"]) | VALUE,
        "user": TEXT,
    },
)
# Header values as bytes on the wire: any text but control characters (which no HTTP client sends).
HEADER = st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=40).map(str.strip) | st.sampled_from(
    ["²", "nan", "inf", "-1", "1e400", "0", "0.5", "k" * 600, "é"]
)
JOB_ID = st.sampled_from(
    ["00000000-0000-0000-0000-000000000000", "%ff%fe", "%00", "%C2%B2", "a" * 100, "%20", "..%2F..", "x%0Ay"]
) | st.text(max_size=40).map(lambda t: quote(t, safe=""))


def json_text(body: Any) -> bytes:
    """``body`` as JSON, with the placeholders spelled as no encoder would."""
    text = json.dumps(body)
    text = text.replace(json.dumps(HUGE), "9" * 5000).replace(json.dumps(SURROGATE), '"\\ud800"')
    return text.encode()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    yield from running(make_stack(tmp_path_factory.mktemp("http-fuzz"), postgres, models_dir, http=True))


@pytest.fixture(scope="module")
def http(stack: LocalStack, as_it_was: Healthy) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.http_url, timeout=30) as client:
        yield client


def openai_error(response: httpx.Response) -> dict[str, Any]:
    """The response's error, which is OpenAI's: never a 500, always its JSON shape."""
    assert response.status_code < 500, (response.status_code, response.text[:500])
    assert response.status_code >= 400, (response.status_code, response.text[:200])
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return dict(error)


def answered(response: httpx.Response) -> None:
    """Any answer but a 500; an error in OpenAI's shape."""
    if response.status_code >= 400:
        param = openai_error(response)["param"]
    else:
        assert response.status_code < 300, response.status_code
        param = None
    # How deep the examples went: --hypothesis-show-statistics shows these.
    event(f"{response.request.method} {response.status_code} {param or ''}".strip())


class Healthy:
    """The HTTP process as it was: the same one (never restarted), serving, with
    no traceback in its log since then, and its memory as it was (within
    ``MEMORY_SLACK``)."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.pid = stack.services["http"].pid
        self.log_from = len(stack.services["http"].log_tail(10**8))
        self.rss = psutil.Process(self.pid).memory_info().rss

    def check(self, key: str = "") -> None:
        http = self.stack.services["http"]
        assert http.pid == self.pid and http.restarts == 0, "the HTTP process was restarted"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        served = httpx.get(f"{self.stack.http_url}/v1/models", headers=headers)
        assert served.status_code == 200, served.text
        log = http.log_tail(10**8)[self.log_from :]
        assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
        rss = psutil.Process(self.pid).memory_info().rss
        assert rss < self.rss + MEMORY_SLACK, f"the HTTP process grew from {self.rss >> 20} to {rss >> 20} MiB"


@pytest.fixture(scope="module")
def as_it_was(stack: LocalStack) -> Healthy:
    """The HTTP process before the first request of this module."""
    return Healthy(stack)


def cancel_everything(stack: LocalStack) -> None:
    """The jobs a fuzz run submitted (valid bodies are jobs), so that the next test finds an idle sampler."""
    client = stub(stack)
    live = [pb.JOB_STATUS_QUEUED, pb.JOB_STATUS_SCHEDULED, pb.JOB_STATUS_RUNNING, pb.JOB_STATUS_DECODING]

    def cancel_the_live() -> list[str]:
        """Cancels the live jobs (a running one stops at its next step); those it found."""
        found = [j.job_id for j in client.ListJobs(pb.ListJobsRequest(page_size=200, statuses=live)).jobs]
        for job_id in found:
            client.CancelJob(pb.CancelJobRequest(job_id=job_id))
        return found

    wait_for(cancel_the_live, lambda found: not found, timeout=120, what="the fuzzed jobs to end")


def a_job(http: httpx.Client) -> str:
    posted = http.post(
        "/v1/images/generations",
        json={"prompt": "a fox", "model": "tiny", "size": "64x64", "steps": 2},
        headers={"Prefer": "respond-async"},
    )
    assert posted.status_code == 202, posted.text
    return str(posted.json()["id"])


# Each input that was a plain-text 500 (finding 5), and the parameter its 400 names.
BAD_INPUT = [
    ("GET", "/v1/files/{job}/0?expires=1%C2%B2&signature=ab", {}, b"", "expires"),  # '²', a digit to isdigit()
    ("GET", "/v1/files/{job}/0?expires=4102444800&signature=%C3%A9%C3%A9", {}, b"", "signature"),  # 'éé'
    ("GET", "/v1/files/{job}/0?expires=" + "9" * 5000 + "&signature=ab", {}, b"", "expires"),
    ("POST", "/v1/images/generations", {}, b'{"prompt": "x", "size": "6\\u00b2x64"}', "size"),
    ("POST", "/v1/images/generations", {}, b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}", "n"),
    ("POST", "/v1/images/generations", {}, b'{"prompt": "x", "seed": -' + b"9" * 5000 + b"}", "seed"),
    ("POST", "/v1/images/generations", {}, b'{"prompt": "\\ud800"}', "prompt"),
    ("POST", "/v1/images/generations", {}, b"[" * 200_000, "body"),
    (
        "POST",
        "/v1/images/generations",
        {b"Idempotency-Key": "cl\u00e9".encode()},
        b'{"prompt": "x"}',
        "Idempotency-Key",
    ),
    ("POST", "/v1/videos", {b"Content-Type": b"application/json"}, b'{"prompt": "x", "size": "6\\u00b2x48"}', "size"),
    ("GET", "/v1/jobs?limit=%C2%B2", {}, b"", "limit"),
    ("GET", "/v1/videos?limit=%C2%B2", {}, b"", "limit"),
    (
        "POST",
        "/v1/images/edits",
        {b"Content-Type": b"multipart/form-data; boundary=b"},
        b'--b\r\nContent-Disposition: form-data; name="prompt"\r\nContent-Type: text/plain; charset=x-bogus\r\n\r\n'
        b"x\r\n--b--\r\n",
        "body",
    ),
]


@pytest.mark.parametrize(("method", "path", "headers", "body", "param"), BAD_INPUT)
def test_input_that_was_a_500_is_a_400_naming_it(
    stack: LocalStack, http: httpx.Client, method: str, path: str, headers: dict[bytes, bytes], body: bytes, param: str
) -> None:
    job = a_job(http) if "{job}" in path else ""
    before = count_jobs(stack)
    refused = http.request(method, path.replace("{job}", job), headers=headers, content=body or None)
    assert refused.status_code == 400, refused.text[:300]
    error = openai_error(refused)
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert count_jobs(stack) == before, "nothing stored"


def raw_exchange(stack: LocalStack, head: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Sends ``head`` and only ``body`` of the body it declares, over a socket, and
    reads the answer: one that needed the rest of the body never comes."""
    with socket.create_connection((stack.settings.http.host, stack.settings.http.port), timeout=10) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            assert chunk, "the connection closed without an answer"
            reply += chunk
        top, _, rest = reply.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in top.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        while len(rest) < length:
            chunk = s.recv(65536)
            assert chunk, "the connection closed mid-answer"
            rest += chunk
    return int(top.split(b" ")[1]), json.loads(rest[:length])


def head(path: str, length: int, *extra: str, content_type: str = "application/json") -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: darkroom", f"Content-Type: {content_type}", f"Content-Length: {length}"]
    return "\n".join([*lines, *extra, ""])


def test_a_body_over_its_route_s_limit_is_refused_before_it_is_read(stack: LocalStack, http: httpx.Client) -> None:
    began = time.monotonic()
    status, body = raw_exchange(stack, head("/v1/images/generations", JSON_BODY_BYTES + 1), b"{")
    assert (status, body["error"]["param"]) == (413, "body")
    edit_limit = upload_bytes(stack.settings.http.max_input_mb)
    form = "multipart/form-data; boundary=b"
    status, _ = raw_exchange(stack, head("/v1/images/edits", edit_limit + 1, content_type=form), b"--b")
    assert status == 413
    status, _ = raw_exchange(stack, head("/v1/videos", JSON_BODY_BYTES + 1), b"{")
    assert status == 413
    assert time.monotonic() - began < 5, "answered without waiting for the bodies"

    # A body that declares no length is cut off at the limit, not read whole.
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 2**16  # 2.5 MiB in all
        yield b'"}'

    refused = http.post("/v1/images/generations", content=chunks())
    assert refused.status_code == 413 and openai_error(refused)["param"] == "body"
    # Under the limit, a generation's body is read as before.
    assert http.post("/v1/images/generations", json={"prompt": "x" * 5000}).json()["error"]["param"] == "prompt"


@FUZZ
@example(  # a valid job but for a NUL, which PostgreSQL's text cannot hold
    body={"prompt": "a\x00b", "model": "tiny", "size": "64x64", "steps": 2},
    route="/v1/images/generations",
    content_type="application/json",
    prefer_junk="",
)
@example(
    body={"prompt": "waves", "negative_prompt": "\x00"},
    route="/v1/videos",
    content_type="application/json",
    prefer_junk="",
)
@given(
    body=BODY | NEAR_VALID | st.binary(max_size=64).map(lambda b: {"raw": b}),
    route=st.sampled_from(["/v1/images/generations", "/v1/videos"]),
    content_type=st.sampled_from(
        ["application/json", "application/json; charset=x-bogus", "text/plain", "application/x-www-form-urlencoded"]
    ),
    prefer_junk=HEADER,
)
def test_fuzzed_json_bodies_are_answered_never_a_500(
    stack: LocalStack, http: httpx.Client, body: dict[str, Any], route: str, content_type: str, prefer_junk: str
) -> None:
    raw = body["raw"] if set(body) == {"raw"} and isinstance(body["raw"], bytes) else json_text(body)
    # respond-async: a body that is a valid job is answered at once (the job is cancelled afterwards).
    headers = {b"Content-Type": content_type.encode(), b"Prefer": f"respond-async, {prefer_junk}".strip().encode()}
    answered(http.post(route, content=raw, headers=headers))


def multipart(parts: list[tuple[str, str | None, str | None, bytes]]) -> bytes:
    out = b""
    for name, filename, part_type, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += b"--fuzz\r\nContent-Disposition: " + disposition.encode() + b"\r\n"
        if part_type is not None:
            out += b"Content-Type: " + part_type.encode() + b"\r\n"
        out += b"\r\n" + data + b"\r\n"
    return out + b"--fuzz--\r\n"


PART = st.tuples(
    st.sampled_from(["image", "image[]", "mask", *PARAMETERS]) | st.text(st.characters(codec="ascii"), max_size=8),
    st.none() | st.sampled_from(["in.png", "x"]),
    st.none() | st.sampled_from(["image/png", "text/plain", "text/plain; charset=x-bogus", "application/json"]),
    st.binary(max_size=64) | TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@FUZZ
@given(parts=st.lists(PART, max_size=6), cut=st.integers(0, 40), prefer_junk=HEADER)
def test_fuzzed_forms_are_answered_never_a_500(
    stack: LocalStack, http: httpx.Client, parts: list[Any], cut: int, prefer_junk: str
) -> None:
    body = multipart(parts)
    body = body[: len(body) - cut]  # cut short, sometimes mid-boundary
    headers = {
        b"Content-Type": b"multipart/form-data; boundary=fuzz",
        b"Prefer": f"respond-async, {prefer_junk}".strip().encode(),
    }
    for route in ("/v1/images/edits", "/v1/videos"):
        answered(http.post(route, content=body, headers=headers))


@FUZZ
@given(
    authorization=st.none() | HEADER.map(lambda h: "Bearer " + h) | HEADER,
    idempotency_key=st.none() | HEADER,
    read_timeout=st.none() | HEADER,
    body=NEAR_VALID,
)
def test_fuzzed_headers_are_answered_never_a_500(
    stack: LocalStack,
    http: httpx.Client,
    authorization: str | None,
    idempotency_key: str | None,
    read_timeout: str | None,
    body: dict[str, Any],
) -> None:
    headers = {b"Prefer": b"respond-async"}
    for name, value in (
        ("Authorization", authorization),
        ("Idempotency-Key", idempotency_key),
        ("x-stainless-read-timeout", read_timeout),
    ):
        if value is not None:
            headers[name.encode()] = value.strip().encode()
    answered(http.post("/v1/images/generations", content=json_text(body), headers=headers))
    answered(http.get("/v1/jobs", headers=headers))


@FUZZ
@given(
    job_id=JOB_ID,
    index=st.sampled_from(["0", "1", "²", "99999999", "-1", "%ff"])
    | st.text(max_size=5).map(lambda t: quote(t, safe="")),
    query=st.dictionaries(
        st.sampled_from(["expires", "signature", "limit", "after", "order", "variant"]) | st.text(max_size=5),
        TEXT,
        max_size=4,
    ),
    route=st.sampled_from(
        [
            ("GET", "/v1/files/{id}/{index}"),
            ("GET", "/v1/jobs/{id}"),
            ("GET", "/v1/jobs/{id}/events"),
            ("GET", "/v1/jobs"),
            ("GET", "/v1/videos"),
            ("GET", "/v1/videos/{id}"),
            ("DELETE", "/v1/videos/{id}"),
            ("GET", "/v1/videos/{id}/content"),
            ("PUT", "/v1/images/generations"),
            ("GET", "/v1/{id}"),
        ]
    ),
)
def test_fuzzed_paths_queries_and_signed_links_are_answered_never_a_500(
    stack: LocalStack, http: httpx.Client, job_id: str, index: str, query: dict[str, str], route: tuple[str, str]
) -> None:
    method, template = route
    path = template.replace("{id}", job_id).replace("{index}", index)
    params = {k.replace(HUGE, "9" * 5000): v.replace(SURROGATE, "\ud800") for k, v in query.items()}
    encoded = "&".join(
        f"{quote(k.encode('utf-8', 'surrogatepass'))}={quote(v.encode('utf-8', 'surrogatepass'))}"
        for k, v in params.items()
    )
    answered(http.request(method, f"{path}?{encoded}" if encoded else path))


def test_after_the_fuzz_the_process_is_as_it_was(stack: LocalStack, as_it_was: Healthy) -> None:
    """The fuzz tests' requests left the process as it was before the first of
    them; then the jobs their valid bodies made are cancelled."""
    as_it_was.check()
    cancel_everything(stack)


def test_without_a_key_nothing_is_read_once_tenants_exist(stack: LocalStack, http: httpx.Client) -> None:
    """Last in this module: it closes the gateway by making a tenant."""
    name = f"fuzz-{uuid.uuid4().hex[:6]}"
    darkroom(stack, "tenants", "create", name, "--lane", "free")
    key = darkroom(stack, "keys", "create", name).stdout.strip().splitlines()[-1]
    wait_for(lambda: http.get("/v1/models").status_code, lambda s: s == 401, timeout=10, what="the gateway closed")
    health = Healthy(stack)

    for route, length in (("/v1/images/generations", 1000), ("/v1/images/edits", 30 * 2**20)):
        for presented in ([], ["Authorization: Bearer drk_nobody_0000"], ["Authorization: Basic eDp5"]):
            began = time.monotonic()
            status, body = raw_exchange(stack, head(route, length, *presented), b"{")
            assert status == 401 and body["error"]["code"] == "invalid_api_key", body
            assert time.monotonic() - began < 5, "answered without waiting for the body"
    # A known key's body is read: the request goes on (and its job is refused for its bad field).
    refused = http.post(
        "/v1/images/generations", json={"prompt": "x", "size": "6²x64"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert refused.status_code == 400 and openai_error(refused)["param"] == "size"
    health.check(key)
