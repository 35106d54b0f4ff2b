"""A tenant's own LoRA adapters through the HTTP API (``/v1/adapters``), on a
running stack with a real model store: an upload (a form as httpx writes it, its
file spooled; or its file's part declaring its length, sent on as it arrives) is
the tenant's to list, to name in a generation and to delete, and another
tenant's to do none of; a body over the limit is refused before it is read, a
caller without a key before its body is read; the gateway's refusals (a full
quota, a base model missing from the store) keep their meaning."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.tenant_adapters import FILE
from http_api.adapter_upload import CHUNK_BYTES
from http_api.limits import adapter_upload_bytes
from services import api_keys
from services.db.repository import Repository
from services.db.tenant_records import TenantTerms
from services.models.store.push import content_version, scan_directory
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from tests.conftest import make_stack, running
from tests.helpers import png_size, store_values
from tests.integration.test_http_api_fuzz import head, raw_exchange
from tests.lora_files import attention_layers, write_diffusers_lora
from tests.store_registry import write_store_registry

pytestmark = pytest.mark.integration

# The largest adapter (the gateway's and the HTTP API's, one variable): small, so
# that a body over it is cheap to send, and room for an adapter of two chunks.
LIMIT_MB = 8.0
LIMIT = int(LIMIT_MB * 2**20)
# A model of the registry whose weights are not in the model store.
UNPUSHED = "tiny-unpushed"


@dataclass
class Door:
    stack: LocalStack
    keys: dict[str, str]  # by tenant: "owner", "other", and "full" (room for no adapter)

    def client(self, tenant: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"} if tenant else {}
        return httpx.Client(base_url=self.stack.http_url, headers=headers, timeout=120)

    def sdk(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.stack.http_url}/v1", api_key=self.keys[tenant], max_retries=0)


async def _tenants(database_url: str) -> dict[str, str]:
    repo = Repository(database_url, pool_size=1)
    now = datetime.now(UTC)
    keys = {}
    try:
        for name, terms in (
            ("owner", TenantTerms("free")),
            ("other", TenantTerms("free")),
            ("full", TenantTerms("free", max_adapters=0)),
        ):
            await repo.tenants.create(name, terms, actor="test", now=now)
            issued = api_keys.new_key()
            await repo.tenants.add_key(name, issued, admin=False, actor="test", now=now)
            keys[name] = issued.key
    finally:
        await repo.close()
    return keys


@pytest.fixture(scope="module")
def door(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path, model_store: Any
) -> Iterator[Door]:
    tmp = tmp_path_factory.mktemp("http-adapters")
    # Each role its own identity, as `darkroom up --model-store` gives them.
    store: dict[str, Any] = store_values(model_store)
    registry = write_store_registry(tmp / "registry.toml", UNPUSHED, f"nowhere-{uuid.uuid4().hex[:6]}")
    stack = make_stack(
        tmp / "stack",
        postgres,
        models_dir,
        http=True,
        model_registry=registry,
        max_adapter_mb=LIMIT_MB,
        **store,
    )
    # The tenants exist before the stack starts: its gateway admits no caller without a key from the first.
    keys = asyncio.run(_tenants(stack.settings.kernel.database_url))
    for started in running(stack):
        yield Door(started, keys)


@pytest.fixture(scope="module")
def lora_files(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Two adapter files for the miniature (diffusers' format), of different bytes,
    each longer than a chunk (``CHUNK_BYTES``) for the metadata a trainer wrote in it."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file, save_file

    unet = UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet")
    root = tmp_path_factory.mktemp("loras")
    files = []
    for seed in (1, 2):
        path = write_diffusers_lora(root / str(seed), unet, attention_layers(unet), rank=4, seed=seed)
        path /= "pytorch_lora_weights.safetensors"
        save_file(load_file(path), path, metadata={"ss_tag_frequency": "x" * (CHUNK_BYTES + 2**20)})
        files.append(path.read_bytes())
    assert all(CHUNK_BYTES < len(f) < LIMIT for f in files)
    return files


def version_of(data: bytes, tmp: Path) -> str:
    """The version the gateway makes of a file's bytes."""
    (tmp / FILE).write_bytes(data)
    return content_version(scan_directory(tmp))


def layers_of(models_dir: Path) -> int:
    from diffusers import UNet2DConditionModel

    return len(attention_layers(UNet2DConditionModel.from_pretrained(models_dir / "tiny", subfolder="unet")))


def own(listing: dict[str, Any]) -> list[str]:
    """The caller's own adapters of a listing, as NAME:VERSION (the store's published ones aside)."""
    return sorted(f"{a['name']}:{a['version']}" for a in listing["data"] if a["own"])


def form(*parts: tuple[str, bytes], declared: bool = False) -> bytes:
    """A multipart form of ``parts`` (``file``'s as a file, its length declared where ``declared``), in order."""
    out = b""
    for name, data in parts:
        out += f'--b\r\nContent-Disposition: form-data; name="{name}"'.encode()
        if name == "file":
            out += b'; filename="style.safetensors"' + (
                f"\r\nContent-Length: {len(data)}".encode() if declared else b""
            )
        out += b"\r\n\r\n" + data + b"\r\n"
    return out + b"--b--\r\n"


FORM = {"Content-Type": "multipart/form-data; boundary=b"}


def test_an_upload_is_its_tenant_s_to_list_name_and_delete_and_no_other_s(
    door: Door, lora_files: list[bytes], models_dir: Path, tmp_path: Path
) -> None:
    name = f"style-{uuid.uuid4().hex[:6]}"
    began = time.time()
    with door.client("owner") as owner, door.client("other") as other:
        # A form as httpx (and OpenAI's SDKs) write it: no part declares its length, so the file is spooled.
        uploaded = owner.post(
            "/v1/adapters",
            data={"name": name, "base_model": "tiny"},
            files={"file": ("style.safetensors", lora_files[0], "application/octet-stream")},
        )
        assert uploaded.status_code == 200, uploaded.text
        first = uploaded.json()
        # Its version is made from its bytes: the gateway got the file's, in order, none lost.
        assert (first["object"], first["name"]) == ("adapter", name)
        assert first["version"] == version_of(lora_files[0], tmp_path)
        assert (first["family"], first["base_model"], first["rank"]) == ("tiny", "tiny", 4)
        assert (first["layers"], first["size_bytes"]) == (layers_of(models_dir), len(lora_files[0]))
        assert (first["own"], first["published"], first["skipped"]) == (True, False, [])
        assert began - 1 <= first["created_at"] <= time.time() + 1

        # A second version, its file's part declaring its length: sent on as it arrives.
        second = owner.post(
            "/v1/adapters", content=form(("name", name.encode()), ("file", lora_files[1]), declared=True), headers=FORM
        )
        assert second.status_code == 200, second.text
        assert (second.json()["name"], second.json()["version"]) == (name, version_of(lora_files[1], tmp_path))
        versions = sorted([f"{name}:{first['version']}", f"{name}:{second.json()['version']}"])

        listing = owner.get("/v1/adapters").json()
        assert listing["object"] == "list" and own(listing) == versions
        assert listing["quota"] == {
            "adapters": 2,
            "max_adapters": door.stack.settings.gateway.tenant_adapters_max,
            "size_bytes": len(lora_files[0]) + len(lora_files[1]),
            "max_size_bytes": int(door.stack.settings.gateway.tenant_adapter_mb * 2**20),
        }
        theirs = other.get("/v1/adapters").json()
        assert own(theirs) == [] and name not in [a["name"] for a in theirs["data"]]
        assert theirs["quota"]["adapters"] == 0

        # A generation through the OpenAI door names it: its tenant's job takes it, another's is refused alike.
        made = door.sdk("owner").images.generate(
            model="tiny", prompt="a lighthouse", size="64x64", extra_body={"steps": 2, "adapters": [{"name": name}]}
        )
        assert made.data is not None and png_size(base64.b64decode(made.data[0].b64_json or "")) == (64, 64)
        with pytest.raises(openai.BadRequestError) as refused:
            door.sdk("other").images.generate(
                model="tiny", prompt="x", size="64x64", extra_body={"steps": 2, "adapters": [{"name": name}]}
            )
        assert refused.value.param == "adapters[0].name"

        # Another tenant removes nothing of it; its tenant removes a version (the colon URL-encoded), then the rest.
        assert other.delete(f"/v1/adapters/{name}").status_code == 404
        gone = owner.delete(f"/v1/adapters/{name}%3A{first['version']}")
        assert gone.status_code == 200, gone.text
        assert gone.json() == {
            "object": "adapter.deleted",
            "name": f"{name}:{first['version']}",
            "deleted": True,
            "removed": [f"{name}:{first['version']}"],
        }
        assert own(owner.get("/v1/adapters").json()) == [f"{name}:{second.json()['version']}"]
        assert owner.delete(f"/v1/adapters/{name}").json()["removed"] == [f"{name}:{second.json()['version']}"]
        assert own(owner.get("/v1/adapters").json()) == []
        assert owner.delete(f"/v1/adapters/{name}").status_code == 404


def test_a_form_s_mistakes_are_refused_naming_the_parameter_and_nothing_is_kept(
    door: Door, lora_files: list[bytes]
) -> None:
    name = f"late-{uuid.uuid4().hex[:6]}".encode()
    file = ("file", b"x" * 100)
    with door.client("owner") as owner:
        for parts, param in (
            ([("base_model", b"tiny"), file], "name"),
            ([("name", name)], "file"),
            ([("name", name), ("purpose", b"fine-tune"), file], "purpose"),
            ([("name", name), ("name", name), file], "name"),
            ([("name", name), file, file], "file"),
        ):
            refused = owner.post("/v1/adapters", content=form(*parts), headers=FORM)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (parts, refused.text)
        not_a_form = owner.post("/v1/adapters", json={"name": "x", "file": "eA=="})
        assert not_a_form.status_code == 400 and not_a_form.json()["error"]["param"] == "body", not_a_form.text
        # A field after a file whose part declared its length: that file was sent on as it came, under the header
        # the fields before it made.
        late = form(("name", name), ("file", lora_files[0]), ("base_model", b"tiny"), declared=True)
        refused = owner.post("/v1/adapters", content=late, headers=FORM)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "base_model", refused.text
        assert own(owner.get("/v1/adapters").json()) == []


def test_a_body_over_the_limit_is_refused_before_it_is_read(door: Door) -> None:
    stack = door.stack
    key = f"Authorization: Bearer {door.keys['owner']}"
    began = time.monotonic()
    # A body declaring more than the route takes: answered with none of it sent.
    status, body = raw_exchange(
        stack, head("/v1/adapters", adapter_upload_bytes(LIMIT_MB) + 1, key, content_type=FORM["Content-Type"]), b"--b"
    )
    assert (status, body["error"]["param"]) == (413, "body")
    # Within the route's limit, a file part declaring more than the largest adapter: answered before it is read.
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="x"\r\n'
    part += f"Content-Length: {LIMIT + 1}\r\n\r\n".encode()
    status, body = raw_exchange(stack, head("/v1/adapters", LIMIT + 1000, key, content_type=FORM["Content-Type"]), part)
    assert (status, body["error"]["param"]) == (413, "file")
    assert time.monotonic() - began < 5, "answered without waiting for the bodies"
    with door.client("owner") as owner:
        # A file that declares nothing is refused once it passes the largest adapter, within the route's limit.
        over = owner.post(
            "/v1/adapters", data={"name": "big"}, files={"file": ("big.safetensors", b"\0" * (LIMIT + 1))}
        )
        assert over.status_code == 413 and over.json()["error"]["param"] == "file", over.text
        assert own(owner.get("/v1/adapters").json()) == []


def test_a_caller_without_a_key_is_refused_before_its_body_is_read(door: Door) -> None:
    began = time.monotonic()
    status, body = raw_exchange(door.stack, head("/v1/adapters", LIMIT, content_type=FORM["Content-Type"]), b"--b")
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    assert time.monotonic() - began < 5, "answered without waiting for the body"
    with door.client(None) as stranger:
        refused = stranger.post("/v1/adapters", data={"name": "x"}, files={"file": ("x.safetensors", b"x")})
        assert refused.status_code == 401
        assert stranger.get("/v1/adapters").status_code == 401
        assert stranger.delete("/v1/adapters/x").status_code == 401


def test_the_gateway_s_refusals_keep_their_meaning(door: Door) -> None:
    """Refused from the upload's first message, before the file is checked: a full
    quota (429, not to be retried: only a removal or an operator frees room); a base
    model whose weights the store lacks (400, which OpenAI's SDKs do not retry)."""
    with door.client("full") as full, door.client("owner") as owner:
        quota = full.post("/v1/adapters", data={"name": "one"}, files={"file": ("one.safetensors", b"x" * 100)})
        assert quota.status_code == 429 and quota.headers["x-should-retry"] == "false", quota.text
        assert full.get("/v1/adapters").json()["quota"]["max_adapters"] == 0
        missing = owner.post(
            "/v1/adapters",
            data={"name": "lost", "base_model": UNPUSHED},
            files={"file": ("lost.safetensors", b"x" * 100)},
        )
        assert missing.status_code == 400, missing.text
        assert missing.json()["error"]["code"] == "failed_precondition"
        assert "is not in the model store" in missing.json()["error"]["message"]
        unknown = owner.post(
            "/v1/adapters", data={"name": "x", "base_model": "no-such-model"}, files={"file": ("x", b"x")}
        )
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "base_model", unknown.text
        # A file part longer than the length it declares: the door's refusal, before the gateway sees the excess.
        lying = form(("name", b"lying"), ("file", b"x" * 100), declared=True)
        lying = lying.replace(b"Content-Length: 100", b"Content-Length: 10")
        longer = owner.post("/v1/adapters", content=lying, headers=FORM)
        assert longer.status_code == 400 and longer.json()["error"]["param"] == "file", longer.text
        assert "longer than its Content-Length of 10 bytes" in longer.json()["error"]["message"]
