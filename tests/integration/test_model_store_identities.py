"""The model store's identities, against a real S3 server (seaweedfs), each with
only the rights its holder uses: the reader's (the decoders') reads a model but
cannot push, re-point latest, remove or share compiled artifacts; the samplers'
also writes compiled artifacts and nothing else; the gateway's reads manifests and
keeps tenants' adapters, and reads no model's bytes nor writes a compiled artifact;
the writer's stays with the operator's CLI; and `darkroom up --model-store` hands
each role its own, the writer to no service."""

from __future__ import annotations

import asyncio
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from services.config.model_store import ModelStoreSettings
from services.config.sections import KernelSettings
from services.models.store.errors import ModelStoreError
from services.models.store.manifest import Manifest
from services.models.store.objects import ObjectStore
from services.models.store.push import file_digest, push_directory
from services.ops.embedded import EmbeddedPostgres
from tests.conftest import make_stack
from tests.integration.test_model_store import darkroom

pytestmark = pytest.mark.integration

# What seaweedfs answers a request its identity may not make (a 403 or AccessDenied).
REFUSED = r"(?i)privileges|denied|forbidden"
STORE_VARIABLES = ("DARKROOM_MODEL_STORE_URL", "DARKROOM_MODEL_STORE_ACCESS_KEY", "DARKROOM_MODEL_STORE_SECRET_KEY")


def store_of(env: dict[str, str]) -> ObjectStore:
    return ObjectStore.from_settings(ModelStoreSettings.from_env(env))


def write_model(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_the_readers_identity_reads_a_model_but_cannot_push_repoint_or_remove_it(
    model_store: Any, tmp_path: Path
) -> None:
    writer, reader = store_of(model_store.env()), store_of(model_store.reader_env())
    weights = os.urandom(300_000)
    # Bytes of its own: the store is the session's, and other modules count what it holds.
    model = write_model(tmp_path / "m", {"model_index.json": b'{"kept": true}', "w.bin": weights})
    pushed = push_directory(writer, model, "kept")
    digest = next(f.digest for f in pushed.manifest.files if f.path == "w.bin")

    assert reader.read_manifest("kept") == pushed.manifest
    fd = os.open(tmp_path / "fetched", os.O_RDWR | os.O_CREAT)
    try:
        asyncio.run(reader.read_blob(digest, len(weights), fd))
    finally:
        os.close(fd)
    assert (tmp_path / "fetched").read_bytes() == weights

    forged = write_model(tmp_path / "forged", {"w.bin": b"not the model"})
    with pytest.raises(ModelStoreError, match=REFUSED):
        reader.put_blob(file_digest(forged / "w.bin"), forged / "w.bin")
    with pytest.raises(ModelStoreError, match=REFUSED):
        reader.write_manifest(Manifest("kept", "forged", pushed.manifest.files, {}))  # and latest after it
    with pytest.raises(ModelStoreError, match=REFUSED):
        push_directory(reader, forged, "kept:forged")
    with pytest.raises(ModelStoreError, match=REFUSED):
        reader.remove("kept")

    assert writer.latest_version("kept") == pushed.manifest.version
    assert [v.version for v in writer.list_models() if v.name == "kept"] == [pushed.manifest.version]
    assert all(writer.has_blob(d) for d in pushed.manifest.blobs())
    assert not writer.has_blob(file_digest(forged / "w.bin"))
    writer.remove("kept")


def test_only_the_samplers_identity_shares_compiled_artifacts_and_it_writes_nothing_else(model_store: Any) -> None:
    # Samplers share what they compiled (services/models/compile_cache.py) under compiled/ alone.
    sampler = store_of(model_store.sampler_env())
    digest = os.urandom(32).hex()
    assert sampler.read_compiled(digest) is None
    sampler.write_compiled(digest, b"artifacts")
    assert sampler.read_compiled(digest) == b"artifacts"
    assert store_of(model_store.env()).read_compiled(digest) == b"artifacts"
    with pytest.raises(ModelStoreError, match=REFUSED):
        sampler.write_manifest(Manifest("compiled", "v1", (), {}))
    # A decoder's and a gateway's identities are refused a compiled artifact: what a
    # sampler loads from there runs, and those face the internet or the samplers' output.
    for env in (model_store.reader_env(), model_store.gateway_env()):
        with pytest.raises(ModelStoreError, match=REFUSED):
            store_of(env).write_compiled(digest, b"planted")
        with pytest.raises(ModelStoreError, match=REFUSED):
            store_of(env).read_compiled(digest)  # what only samplers load
    assert sampler.read_compiled(digest) == b"artifacts"


def test_the_gateways_identity_reads_manifests_and_keeps_tenants_adapters_and_nothing_else(
    model_store: Any, tmp_path: Path
) -> None:
    writer, gateway = store_of(model_store.env()), store_of(model_store.gateway_env())
    model = write_model(tmp_path / "m", {"model_index.json": b'{"gateway": 1}', "w.bin": os.urandom(20_000)})
    pushed = push_directory(writer, model, "gateway-reads")
    digest = next(f.digest for f in pushed.manifest.files if f.path == "w.bin")

    assert gateway.read_manifest("gateway-reads") == pushed.manifest  # an adapter's entry, by its name
    with pytest.raises(ModelStoreError, match=REFUSED):
        gateway.small_blob(digest)  # no model's bytes
    with pytest.raises(ModelStoreError, match=REFUSED):
        gateway.read_compiled(os.urandom(32).hex())
    with pytest.raises(ModelStoreError, match=REFUSED):
        gateway.write_manifest(Manifest("gateway-reads", "forged", pushed.manifest.files, {}))
    with pytest.raises(ModelStoreError, match=REFUSED):
        push_directory(gateway, model, "gateway-pushed")

    # A tenant's own adapters: a store of their own under tenants/, pushed, read, listed and removed.
    tenant = gateway.scoped("tenants/acme/")
    adapter = write_model(tmp_path / "a", {"adapter.safetensors": os.urandom(5_000)})
    kept = push_directory(tenant, adapter, "style:v1")
    assert tenant.read_manifest("style", "v1") == kept.manifest
    assert [v.version for v in tenant.list_models()] == ["v1"]
    assert writer.scoped("tenants/acme/").read_manifest("style") == kept.manifest
    assert store_of(model_store.sampler_env()).scoped("tenants/acme/").read_manifest("style") == kept.manifest
    with pytest.raises(ModelStoreError, match=REFUSED):  # a decoder reads models, not tenants' adapters
        store_of(model_store.reader_env()).scoped("tenants/acme/").read_manifest("style")
    assert writer.latest_version("style") is None  # not among the operator's models
    tenant.remove("style")
    assert tenant.list_models() == []
    writer.remove("gateway-reads")


def answer(url: str, data: bytes | None = None, method: str = "GET") -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_no_other_http_port_of_the_store_writes_the_bucket_or_shows_an_identity(model_store: Any) -> None:
    """S3, with its identities, is the store's one HTTP door: weed's filer API would
    write any object with no identity, its admin API list the identities' secrets
    and make new ones."""
    reader = store_of(model_store.reader_env())
    filer, admin = (f"http://127.0.0.1:{model_store.ports[p]}" for p in ("filer.port", "admin.port"))
    forged = answer(f"{filer}/buckets/{model_store.bucket}/manifests/victim/latest", b"forged", "PUT")
    assert forged[0] == 404
    assert reader.latest_version("victim") is None
    for path in ("/api/users", "/api/s3/buckets"):
        status, body = answer(admin + path)
        assert status == 404 and model_store.writer.secret_key.encode() not in body, path
    made = answer(f"{admin}/api/users", b'{"username": "intruder", "actions": ["Admin"]}', "POST")
    assert made[0] == 404


def test_the_cli_pushes_and_removes_with_the_writer_and_is_refused_with_the_reader(
    model_store: Any, tmp_path: Path
) -> None:
    root = write_model(tmp_path / "m", {"model_index.json": b'{"who": 1}', "w.bin": os.urandom(10_000)})
    reader_only = {**os.environ, **model_store.reader_env(), "DARKROOM_DATA_DIR": str(tmp_path / "data")}
    refused = darkroom(reader_only, "push", str(root), "by-cli")
    assert refused.returncode == 1 and "DARKROOM_MODEL_STORE_WRITER_ACCESS_KEY" in refused.stderr, refused.stderr
    listed = darkroom(reader_only, "list")  # no service lists the bucket: the reader may not either
    assert listed.returncode == 1 and "refused" in listed.stderr, listed.stderr

    writer = model_store.env()
    operator = {
        **reader_only,
        "DARKROOM_MODEL_STORE_WRITER_ACCESS_KEY": writer["DARKROOM_MODEL_STORE_ACCESS_KEY"],
        "DARKROOM_MODEL_STORE_WRITER_SECRET_KEY": writer["DARKROOM_MODEL_STORE_SECRET_KEY"],
    }
    pushed = darkroom(operator, "push", str(root), "by-cli")
    assert pushed.returncode == 0, pushed.stderr
    assert "by-cli " in darkroom(operator, "list").stdout
    assert darkroom(reader_only, "rm", "by-cli").returncode == 1
    removed = darkroom(operator, "rm", "by-cli")
    assert removed.returncode == 0, removed.stderr


def test_up_gives_each_role_its_own_identity_and_the_writer_to_no_service(
    tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path
) -> None:
    # The operator's own writer in the environment `up` runs in: no child may inherit it.
    operator_writer = "operator-writer-secret"
    stack = make_stack(
        tmp_path / "stack",
        postgres,
        models_dir,
        http=True,
        model_store_writer_access_key="operator-writer",
        model_store_writer_secret_key=operator_writer,
    )
    stack.start_model_store = True  # what `darkroom up --model-store` asks for
    try:
        stack.start()
        store = stack.model_store
        assert store is not None
        secrets = Path(stack.settings.kernel.mesh_dir)
        for role in ("writer", "sampler", "reader", "gateway"):
            secret_file = secrets / f"model-store-{role}.secret"
            assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600, role
            assert secret_file.read_text().strip() == getattr(store.identities, role).secret_key, role
        writer_secret = store.writer.secret_key
        role_secrets = {store.identities.sampler.secret_key, store.identities.gateway.secret_key}

        services = {name: c.service for name, c in stack.services.items()}
        assert sorted(set(services.values())) == ["decoder", "gateway", "http", "sampler", "scheduler"]
        identity_of = {
            "sampler": store.identities.sampler,
            "decoder": store.reader,
            "gateway": store.identities.gateway,
        }
        for name, c in stack.services.items():
            values = " ".join(c.env.values())
            assert writer_secret not in values and operator_writer not in values, name
            held = {v: c.env.get(v, "") for v in STORE_VARIABLES}
            own = identity_of.get(c.service)
            if own is not None:
                assert held == dict(zip(STORE_VARIABLES, (store.url, own.access_key, own.secret_key), strict=True)), (
                    name
                )
                assert not (role_secrets - {own.secret_key}) & set(c.env.values()), name  # no other role's
            else:
                assert held == dict.fromkeys(STORE_VARIABLES, ""), name
                assert not role_secrets & set(c.env.values()), name

        # A sampler's identity, as its process reads it, may read but not push.
        sampler = next(c for c in stack.services.values() if c.service == "sampler")
        as_sampler = ObjectStore.from_settings(KernelSettings.from_env(sampler.env).model_store)
        model = write_model(tmp_path / "m", {"w.bin": b"weights"})
        with pytest.raises(ModelStoreError, match=REFUSED):
            push_directory(as_sampler, model, "from-a-sampler")
        pushed = push_directory(store_of(store.env()), model, "from-the-operator")
        assert as_sampler.read_manifest("from-the-operator") == pushed.manifest
    finally:
        stack.stop()
