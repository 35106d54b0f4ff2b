"""The model store against a real S3 server (seaweedfs): pushes store each distinct
file once, removal collects only unshared blobs, ranged reads give the exact bytes,
and bad input or a dead store is refused clearly with nothing stored."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import obstore
import pytest

from services.config.model_store import ModelStoreSettings
from services.errors import ModelError
from services.models.store.errors import ModelNotInStore, ModelStoreError
from services.models.store.manifest import manifest_key
from services.models.store.objects import ObjectStore
from services.models.store.push import content_version, file_digest, push_directory, source_directory
from services.ops.processes import free_port
from tests.helpers import cli_here

MB = 1024 * 1024


def client(model_store: Any, **env: str) -> ObjectStore:
    return ObjectStore.from_settings(ModelStoreSettings.from_env({**model_store.env(), **env}))


def write_model(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def noise(seed: str, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def stored_versions(store: ObjectStore, name: str) -> list[str]:
    return [v.version for v in store.list_models() if v.name == name]


def test_a_builtin_pushes_as_its_content_version(model_store: Any, models_dir: Path) -> None:
    store = client(model_store)
    root = source_directory("builtin:tiny", models_dir)
    result = push_directory(store, root, "tiny-pushed")
    manifest = store.read_manifest("tiny-pushed")  # the latest
    assert manifest == result.manifest
    assert manifest.version == content_version(manifest.files)
    assert {f.path: f.digest for f in manifest.files} == {
        p.relative_to(root).as_posix(): file_digest(p) for p in root.rglob("*") if p.is_file()
    }
    assert all(store.has_blob(d) for d in manifest.blobs())


def test_an_unchanged_directory_pushes_no_blob_and_the_same_version(model_store: Any, tmp_path: Path) -> None:
    store = client(model_store)
    root = write_model(tmp_path / "m", {"model_index.json": b"{}", "unet/w.bin": noise("unchanged", MB)})
    first = push_directory(store, root, "unchanged")
    second = push_directory(store, root, "unchanged")
    assert len(first.uploaded) == 2 and first.present == {}
    assert second.uploaded == {} and second.present == first.uploaded
    assert second.manifest == first.manifest
    assert stored_versions(store, "unchanged") == [first.manifest.version]


def test_shared_files_are_stored_once_and_removal_keeps_what_another_version_uses(
    model_store: Any, tmp_path: Path
) -> None:
    store = client(model_store)
    shared, old_only, new_only = noise("shared", 300_000), noise("old", 200_000), noise("new", 100_000)
    old = push_directory(store, write_model(tmp_path / "v1", {"a.bin": shared, "b.bin": old_only}), "sharing:v1")
    new = push_directory(store, write_model(tmp_path / "v2", {"a.bin": shared, "c.bin": new_only}), "sharing:v2")
    shared_digest = old.manifest.files[0].digest
    assert set(new.uploaded) == {new.manifest.files[1].digest}  # only c.bin
    assert set(new.present) == {shared_digest}
    listed = {v.version: v for v in store.list_models() if v.name == "sharing"}
    assert set(listed) == {"v1", "v2"} and listed["v2"].latest and not listed["v1"].latest
    assert listed["v1"].total_bytes == 500_000 and listed["v1"].files == 2

    removal = store.remove("sharing", "v2")  # the latest: it falls back to v1
    assert removal.versions == ("v2",) and removal.blobs_deleted == 1 and removal.bytes_deleted == 100_000
    assert not store.has_blob(new.manifest.files[1].digest) and store.has_blob(shared_digest)
    assert store.latest_version("sharing") == "v1"
    assert store.read_manifest("sharing") == old.manifest

    removal = store.remove("sharing")  # every version left
    assert removal.versions == ("v1",) and removal.blobs_deleted == 2 and removal.blobs_kept == 0
    assert not any(store.has_blob(d) for d in old.manifest.blobs())
    assert stored_versions(store, "sharing") == [] and store.latest_version("sharing") is None


def test_a_blob_another_model_uses_survives_removal(model_store: Any, tmp_path: Path) -> None:
    store = client(model_store)
    common = noise("cross-model", 50_000)
    one = push_directory(store, write_model(tmp_path / "one", {"w.bin": common}), "cross-one")
    push_directory(store, write_model(tmp_path / "two", {"x/w.bin": common}), "cross-two")
    assert store.remove("cross-one").blobs_kept == 1
    assert store.has_blob(one.manifest.files[0].digest)


@pytest.mark.parametrize("offset", [0, 1, MB + 7])
def test_read_blob_writes_the_exact_bytes_from_an_offset_in_ranges(
    model_store: Any, tmp_path: Path, offset: int
) -> None:
    store = client(model_store, DARKROOM_MODEL_FETCH_RANGE_MB="1", DARKROOM_MODEL_FETCH_STREAMS="3")
    data = noise("ranged", 3 * MB + 12345)  # four ranges, the last short
    pushed = push_directory(store, write_model(tmp_path / "m", {"w.bin": data}), "ranged")
    digest = pushed.manifest.files[0].digest
    dest = tmp_path / "dest"
    counted: list[int] = []
    sent_before = model_store.sent_bytes()
    fd = os.open(dest, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"\xee" * offset, 0)  # what a partial download left: kept as it is
        asyncio.run(store.read_blob(digest, len(data), fd, offset=offset, on_bytes=counted.append))
    finally:
        os.close(fd)
    assert dest.read_bytes() == b"\xee" * offset + data[offset:]
    assert sum(counted) == len(data) - offset and max(counted) <= MB
    # The counter the fleet suite proves "each blob served once" with sees these bytes.
    deadline = time.monotonic() + 10
    while model_store.sent_bytes() - sent_before < len(data) - offset and time.monotonic() < deadline:
        time.sleep(0.1)
    assert model_store.sent_bytes() - sent_before >= len(data) - offset


def test_read_blob_of_a_missing_blob_fails_clearly(model_store: Any, tmp_path: Path) -> None:
    store = client(model_store)
    fd = os.open(tmp_path / "dest", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(ModelStoreError, match="0" * 64):
            asyncio.run(store.read_blob("0" * 64, 1000, fd))
    finally:
        os.close(fd)


def test_absent_or_unreadable_manifests_name_the_model(model_store: Any) -> None:
    store = client(model_store)
    with pytest.raises(ModelNotInStore, match="'never-pushed'"):
        store.read_manifest("never-pushed")
    with pytest.raises(ModelNotInStore, match="never-pushed:v9"):
        store.read_manifest("never-pushed", "v9")
    with pytest.raises(ModelNotInStore, match="never-pushed"):
        store.remove("never-pushed")
    obstore.put(store._store, manifest_key("garbled", "v1"), b"{not json")
    with pytest.raises(ModelError, match="not a model manifest"):
        store.read_manifest("garbled", "v1")
    obstore.delete(store._store, manifest_key("garbled", "v1"))


def test_bad_input_is_refused_and_nothing_is_stored(model_store: Any, tmp_path: Path) -> None:
    store = client(model_store)
    before = store.list_models()
    root = write_model(tmp_path / "m", {"w.bin": noise("refused", 1000)})
    for reference in ("../up", "", "a:b:c", "-dash", "name:ver/sion"):
        with pytest.raises(ModelError):
            push_directory(store, root, reference)
    with pytest.raises(ModelError, match="no such directory"):
        source_directory(str(tmp_path / "absent"), tmp_path)
    with pytest.raises(ModelError, match="unknown builtin"):
        source_directory("builtin:nope", tmp_path)
    with pytest.raises(ModelError, match="no files"):
        (tmp_path / "empty").mkdir()
        push_directory(store, tmp_path / "empty", "empty")
    assert store.list_models() == before
    assert not store.has_blob(file_digest(root / "w.bin"))


def test_a_store_that_is_down_or_unconfigured_fails_fast_and_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="DARKROOM_MODEL_STORE_URL"):
        ObjectStore.from_settings(ModelStoreSettings.from_env({}))
    down = ObjectStore.from_settings(
        ModelStoreSettings.from_env({"DARKROOM_MODEL_STORE_URL": f"http://127.0.0.1:{free_port()}"})
    )
    started = time.monotonic()
    with pytest.raises(ModelStoreError, match=r"model store http://127\.0\.0\.1"):
        push_directory(down, write_model(tmp_path / "m", {"w.bin": b"x"}), "down")
    assert time.monotonic() - started < 30


def darkroom(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``darkroom models ARGS`` with ``env`` as its environment (in this process: see ``cli_here``)."""
    return cli_here(env, "models", *args)


def test_the_cli_pushes_lists_and_removes(model_store: Any, tmp_path: Path) -> None:
    env = {**os.environ, **model_store.env(), "DARKROOM_DATA_DIR": str(tmp_path / "data")}
    root = write_model(tmp_path / "m", {"model_index.json": b'{"cli": 1}', "w.bin": noise("cli", 20_000)})
    pushed = darkroom(env, "push", str(root), "cli-model")
    assert pushed.returncode == 0, pushed.stderr
    version = pushed.stdout.split()[-1]
    assert "uploaded 2 blobs" in pushed.stdout
    again = darkroom(env, "push", str(root), "cli-model:pinned")
    assert again.returncode == 0 and "uploaded 0 blobs" in again.stdout and "2 already in the store" in again.stdout
    listed = darkroom(env, "list")
    assert listed.returncode == 0
    rows = [line.split() for line in listed.stdout.splitlines() if line.startswith("cli-model ")]
    assert sorted(r[1] for r in rows) == sorted([version, "pinned"])
    assert [r[1] for r in rows if r[-1] == "*"] == ["pinned"]  # the last pushed
    removed = darkroom(env, "rm", "cli-model")
    assert removed.returncode == 0 and "deleted 2 blobs" in removed.stdout

    for args, expected in (
        (("push", str(tmp_path / "absent"), "x"), "no such directory"),
        (("push", str(root), "../x"), "model name '../x'"),
        (("rm", "cli-model"), "not in the model store"),
    ):
        failed = darkroom(env, *args)
        assert failed.returncode != 0 and expected in failed.stderr, failed.stderr
    unconfigured = {k: v for k, v in env.items() if not k.startswith("DARKROOM_MODEL_STORE")}
    failed = darkroom(unconfigured, "list")
    assert failed.returncode != 0 and "DARKROOM_MODEL_STORE_URL" in failed.stderr
    down = {**env, "DARKROOM_MODEL_STORE_URL": f"http://127.0.0.1:{free_port()}"}
    failed = darkroom(down, "push", str(root), "cli-down")
    assert failed.returncode != 0 and "model store http://127.0.0.1" in failed.stderr
    assert "cli-down" not in darkroom(env, "list").stdout


def test_up_with_a_model_store_starts_one_and_points_its_children_at_it(
    tmp_path: Path, postgres: Any, models_dir: Path
) -> None:
    from tests.conftest import make_stack

    stack = make_stack(tmp_path / "stack", postgres, models_dir)
    stack.start_model_store = True  # what `darkroom up --model-store` asks for
    try:
        stack.start_backends()
        assert stack.model_store is not None and stack.model_store.running
        settings = stack.settings.kernel.model_store  # what its samplers and decoders read: the reader
        assert settings.model_store_url == stack.model_store.url
        assert settings.model_store_secret_key == stack.model_store.reader.secret_key
        assert stack.settings.to_env()["DARKROOM_MODEL_STORE_URL"] == stack.model_store.url
        operator = ObjectStore.from_settings(ModelStoreSettings.from_env(stack.model_store.env()))
        pushed = push_directory(operator, write_model(tmp_path / "m", {"w.bin": b"up"}), "up-model")
        assert ObjectStore.from_settings(settings).read_manifest("up-model") == pushed.manifest
    finally:
        stack.stop()
    assert stack.model_store is not None and not stack.model_store.running
