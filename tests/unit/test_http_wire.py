"""What the HTTP API reads off the wire before its routes' logic: how long a
request waits and what it gets past that, its idempotency key, and request
parameters that would have been a 500 (a digit that is no ASCII digit, a JSON
integer past Python's 4,300 digits, a lone surrogate) as a 400 naming them; and a
JSON body's values counted before it is parsed, off the event loop."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from http_api import images, videos, wire
from http_api.errors import HttpError
from http_api.wire import LongInteger, _integer, idempotency_key, wait_of
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb


def request(**headers: str):  # type: ignore[no-untyped-def]
    return make_mocked_request("POST", "/v1/images/generations", headers=headers)


@pytest.mark.parametrize(
    ("headers", "seconds", "respond_async"),
    [
        ({}, 600.0, False),
        ({"Prefer": "respond-async"}, 0.0, True),
        ({"Prefer": "respond-async, wait=10"}, 10.0, True),
        ({"Prefer": "wait=10; respond-async"}, 10.0, True),
        ({"Prefer": "respond-async, wait=99999999"}, 600.0, True),
        ({"Prefer": "respond-async, wait=²"}, 0.0, True),
        # What an OpenAI SDK announces: the answer must reach it before it gives up and submits again.
        ({"x-stainless-read-timeout": "600"}, 570.0, False),
        ({"x-stainless-read-timeout": "5.0"}, 4.0, False),
        ({"x-stainless-read-timeout": "nan"}, 600.0, False),
        ({"x-stainless-read-timeout": "-1"}, 600.0, False),
        ({"x-stainless-read-timeout": "1e400"}, 600.0, False),
        ({"x-stainless-read-timeout": "²"}, 600.0, False),
    ],
)
def test_how_long_a_request_waits(headers: dict[str, str], seconds: float, respond_async: bool) -> None:
    wait = wait_of(request(**headers), 600.0)
    assert (wait.seconds, wait.respond_async) == (seconds, respond_async)


def test_an_idempotency_key_is_the_callers_or_one_made_per_request() -> None:
    assert idempotency_key(request(**{"Idempotency-Key": "order-7"})) == "order-7"
    made = {idempotency_key(request()) for _ in range(3)}
    assert len(made) == 3 and all(k.startswith("http-") for k in made)
    for bad in ("", "k" * 257, "clé"):
        with pytest.raises(HttpError) as refused:
            idempotency_key(request(**{"Idempotency-Key": bad}))
        assert (refused.value.status, refused.value.param) == (400, "Idempotency-Key")


def refused(fields: dict, *, form: bool = False) -> HttpError:  # type: ignore[type-arg]
    with pytest.raises(HttpError) as caught:
        images.generation({"prompt": "x", **fields}, form=form)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("fields", "form", "param"),
    [
        ({"size": "6²x64"}, False, "size"),
        ({"size": "\u0666\u0664x64"}, False, "size"),  # Arabic-Indic digits
        ({"n": "²"}, True, "n"),
        ({"n": "1" * 5000}, True, "n"),
        ({"steps": _integer("9" * 5000)}, False, "steps"),
        ({"seed": _integer("-" + "9" * 5000)}, False, "seed"),
        ({"prompt": _integer("9" * 5000)}, False, "prompt"),
        ({"prompt": "a\ud800b"}, False, "prompt"),
        ({"negative_prompt": "\udfff"}, False, "negative_prompt"),
        ({"guidance": float("nan")}, False, "guidance"),
        ({"guidance": "nan"}, True, "guidance"),
        ({"k" * 10_000: 1}, False, "k" * 64),
    ],
)
def test_input_that_was_a_500_is_a_400_naming_it(fields: dict, form: bool, param: str) -> None:  # type: ignore[type-arg]
    error = refused(fields, form=form)
    assert error.param == param and len(error.message) < 300, error.message


def test_a_long_integer_is_kept_unconverted() -> None:
    assert _integer("12") == 12 and _integer("9" * 5000) == LongInteger(5000)


def test_a_video_size_is_ascii_digits() -> None:
    model = pb.ModelInfo(name="tiny-wan", capability="video", default_fps=8, frames_step=4, max_frames=33)
    for size in ("6²x48", "99999999999999999999x48", "64x"):
        with pytest.raises(HttpError) as bad:
            videos.create({"prompt": "waves", "size": size}, model)
        assert bad.value.param == "size"
    assert videos.create({"prompt": "waves", "size": "64x48"}, model).width == 64


def test_a_nul_is_named_before_the_gateway_would_store_it() -> None:
    error = refused({"prompt": "a\x00b"})
    assert error.param == "prompt" and "NUL" in error.message


# -- a JSON body: its values counted before it is parsed, and parsed off the event loop --------


def forbidden(*args: object, **kwargs: object) -> None:
    raise AssertionError("reached: the body was parsed before its values were counted")


def test_a_body_of_more_json_values_than_any_request_takes_is_refused_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 1.1 MiB that a parser would make 200,000 strings of (and the door, before, 200,000 inputs).
    flood = b'{"input": [' + b'"a",' * 200_000 + b'"a"]}'
    deep = b"[" * 100_000 + b"]" * 100_000
    monkeypatch.setattr(wire.json, "loads", forbidden)
    for body in (flood, deep):
        with pytest.raises(HttpError) as refused:
            wire.parse_json(body)
        assert (refused.value.status, refused.value.param) == (400, "body")
        assert f"more than {wire.MAX_JSON_VALUES} JSON values" in refused.value.message


def test_what_a_string_holds_is_no_value_of_the_body() -> None:
    # Commas, brackets, colons and escaped quotes in strings: 32 texts of them are 32 values.
    texts = ['a, [b]: {"c"}, \\ d' * 100] * 32
    assert wire.parse_json(json.dumps({"input": texts}).encode()) == {"input": texts}
    with pytest.raises(HttpError) as refused:
        wire.parse_json(b'{"input": ["a", }')
    assert refused.value.param == "body" and "not JSON" in refused.value.message


async def test_a_json_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    parse = wire.parse_json

    def recorded(raw: bytes) -> Any:
        threads.append(threading.current_thread())
        return parse(raw)

    monkeypatch.setattr(wire, "parse_json", recorded)

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await wire.json_body(request))

    app = web.Application()
    app.router.add_post("/", echo)
    async with TestClient(TestServer(app)) as client:
        answer = await client.post("/", json={"input": ["a", 1]})
        assert await answer.json() == {"input": ["a", 1]}
    assert threads and threads[0] is not threading.main_thread()


def test_adapters_are_a_list_of_names_and_scales_in_json_or_a_form() -> None:
    body = {"adapters": [{"name": "style:v1", "scale": 0.8}, "subject"]}
    request, _ = images.generation({"prompt": "x", **body})
    assert [(a.name, a.HasField("scale"), a.scale) for a in request.adapters] == [
        ("style:v1", True, pytest.approx(0.8)),
        ("subject", False, 0.0),
    ]
    form, _ = images.generation({"prompt": "x", "adapters": json.dumps(body["adapters"])}, form=True)
    assert form.adapters == request.adapters


@pytest.mark.parametrize(
    ("adapters", "form", "param"),
    [
        ({"name": "style"}, False, "adapters"),
        ([{"name": "style", "weight": 1}], False, "adapters[0]"),
        ([{"scale": 1.0}], False, "adapters[0].name"),
        (["style", {"name": "s", "scale": "big"}], False, "adapters[1].scale"),
        ([{"name": 3}], False, "adapters[0].name"),
        ("[style", True, "adapters"),
        (["a"] * 17, False, "adapters"),
    ],
)
def test_bad_adapters_are_a_400_naming_the_one_that_is_wrong(adapters: Any, form: bool, param: str) -> None:
    assert refused({"adapters": adapters}, form=form).param == param
