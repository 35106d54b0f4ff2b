"""The model store's pure parts: the content version a push names, what a
directory's scan takes, and the registry's ``store:`` sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.errors import ModelError
from services.models.registry import ModelRegistry
from services.models.spec import store_reference
from services.models.store.manifest import BlobRef
from services.models.store.push import content_version, file_digest, scan_directory

A = BlobRef("unet/w.bin", 10, "a" * 64)
B = BlobRef("model_index.json", 2, "b" * 64)


def test_the_content_version_is_of_the_files_whatever_their_order() -> None:
    assert content_version((A, B)) == content_version((B, A))
    assert len(content_version((A, B))) == 12 and int(content_version((A, B)), 16) >= 0
    changed = BlobRef(A.path, A.size, "c" * 64)
    assert content_version((changed, B)) != content_version((A, B))
    moved = BlobRef("vae/w.bin", A.size, A.digest)
    assert content_version((moved, B)) != content_version((A, B))


def test_a_scan_takes_every_file_by_path_but_hidden_scratch(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "w.bin").write_bytes(b"weights")
    (tmp_path / "model_index.json").write_bytes(b"{}")
    (tmp_path / ".building-x").mkdir()
    (tmp_path / ".building-x" / "partial").write_bytes(b"half")
    (tmp_path / ".lock").write_bytes(b"")
    files = scan_directory(tmp_path)
    assert [(f.path, f.size) for f in files] == [("model_index.json", 2), ("unet/w.bin", 7)]
    assert files[1].digest == file_digest(tmp_path / "unet" / "w.bin")


def registry(tmp_path: Path, source: str) -> ModelRegistry:
    path = tmp_path / "registry.toml"
    path.write_text(f'[models.stored]\nsource = "{source}"\nfamily = "tiny"\n')
    return ModelRegistry.load(path)


@pytest.mark.parametrize(
    ("source", "reference"), [("store:tiny", ("tiny", None)), ("store:tiny:ca7dfab4b0f5", ("tiny", "ca7dfab4b0f5"))]
)
def test_the_registry_names_store_models(tmp_path: Path, source: str, reference: tuple[str, str | None]) -> None:
    assert store_reference(registry(tmp_path, source).get("stored")) == reference


@pytest.mark.parametrize("source", ["store:", "store:../x", "store:tiny:v/1", "store:a:b:c"])
def test_the_registry_refuses_a_bad_store_reference(tmp_path: Path, source: str) -> None:
    with pytest.raises(ModelError, match="'stored'"):
        registry(tmp_path, source)


def test_other_sources_have_no_store_reference(tmp_path: Path) -> None:
    assert store_reference(registry(tmp_path, "builtin:tiny").get("stored")) is None
