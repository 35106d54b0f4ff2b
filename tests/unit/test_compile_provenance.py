"""What a loaded fleet artifact wrote into the host's compiler cache
(services/models/compile_provenance.py): the files created or rewritten while it
loaded, and only those, are kept as its own, and dropping it deletes them and
nothing outside the cache (tests/integration/test_compile_cache.py does the same
with the files inductor writes)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from services.models.compile_provenance import PROVENANCE_DIR, HostEntries, Provenance


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    return root


def write(path: Path, data: bytes) -> Path:
    """As torch writes its cache: a new file put in place of the old."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name + ".tmp").write_bytes(data)
    os.replace(path.with_name(path.name + ".tmp"), path)
    return path


def test_the_files_a_load_created_or_rewrote_are_its_own_and_dropped_with_it(cache: Path) -> None:
    kept = write(cache / "fxgraph" / "ab" / "kept" / "entry", b"compiled here")
    rewritten = write(cache / "aotautograd" / "key" / "entry", b"before")
    entries = HostEntries()
    with entries.recording("d" * 64, "sha"):
        created = write(cache / "fxgraph" / "cd" / "new" / "entry", b"from the fleet")
        write(rewritten, b"from the fleet")
        write(cache / "locks" / "entry.lock", b"")
    [loaded] = entries.loaded()
    assert loaded == Provenance("d" * 64, "sha", tuple(sorted((str(created), str(rewritten)))))
    assert (cache / PROVENANCE_DIR / f"{'d' * 64}.json").is_file()

    assert entries.drop(loaded) == 2
    assert not created.exists() and not rewritten.exists() and kept.read_bytes() == b"compiled here"
    assert entries.loaded() == []


def test_a_load_that_fails_keeps_what_it_wrote_and_a_second_load_adds_to_it(cache: Path) -> None:
    entries = HostEntries()
    with pytest.raises(RuntimeError), entries.recording("d" * 64, "sha"):
        first = write(cache / "fxgraph" / "a", b"half")
        raise RuntimeError("the load failed halfway")
    with entries.recording("d" * 64, "sha"):  # another sampler of the host loads the same artifact
        second = write(cache / "fxgraph" / "b", b"whole")
    assert entries.loaded() == [Provenance("d" * 64, "sha", (str(first), str(second)))]
    with entries.recording("d" * 64, "other sha"):  # another artifact under the key: its files alone
        third = write(cache / "fxgraph" / "c", b"other")
    assert entries.loaded() == [Provenance("d" * 64, "other sha", (str(third),))]


def test_triton_s_own_cache_elsewhere_is_watched_too(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    entries = HostEntries()
    with entries.recording("d" * 64, "sha"):
        kernel = write(tmp_path / "triton" / "hash" / "kernel.cubin", b"kernel")
    [loaded] = entries.loaded()
    assert loaded.files == (str(kernel),)
    entries.drop(loaded)
    assert not kernel.exists()


def test_dropping_deletes_nothing_outside_the_cache(cache: Path, tmp_path: Path) -> None:
    outside = write(tmp_path / "elsewhere" / "precious", b"not the cache's")
    inside = write(cache / "fxgraph" / "entry", b"cache")
    forged = Provenance("d" * 64, "sha", (str(outside), str(inside), str(cache / ".." / "elsewhere" / "precious")))
    write(cache / PROVENANCE_DIR / f"{'d' * 64}.json", json.dumps(asdict(forged)).encode())
    [loaded] = HostEntries().loaded()
    assert HostEntries().drop(loaded) == 1
    assert outside.read_bytes() == b"not the cache's" and not inside.exists()
