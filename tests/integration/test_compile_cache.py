"""Compiled once per fleet, against a real S3 server (seaweedfs) with inductor on the
CPU: a sampler process that compiles a model shares its artifacts through the model
store under the samplers' identity, beside a record signed with the samplers' key,
and a second process, its own compiler cache empty (another host's), loads them and
generates no code (inductor's graph cache hits, and misses none).

An artifact its record does not vouch for (no record, another key's, another
compile key's, other bytes) is not loaded: nothing reaches the compiler cache, and
the sampler compiles and shares its own in its place. One the operator removes
(`darkroom models compiled rm`), or whose record no longer verifies or names other
bytes, is dropped from the compiler cache of each host that loaded it, whose next
compile generates its code afresh. An artifact that does not load, and a key with
nothing under it, fall back to compiling; a store away changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.config.model_store import ModelStoreSettings
from services.config.workers import SamplerSettings
from services.mesh.secrets import compile_signing_key
from services.models.compile_cache import CacheResult, CompileCache, compile_key
from services.models.compile_provenance import PROVENANCE_DIR, HostEntries, snapshot
from services.models.compile_record import RECORD_SUFFIX, record_of, signed, verified_artifact
from services.models.store.objects import ObjectStore
from services.ops.cli import main as darkroom

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SIGNING = "DARKROOM_COMPILE_SIGNING_KEY_FILE"
WHEN = "2025-01-01T00:00:00+00:00"


def store_of(env: dict[str, str]) -> ObjectStore:
    return ObjectStore.from_settings(ModelStoreSettings.from_env(env))


def load_in_new_process(models_dir: Path, cache_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """A sampler's cold load of a small transformer miniature compiled by inductor at
    one bucket (64 px, batches of one: about 40 s of compiling on two cores), in a
    process of its own whose compiler cache is ``cache_dir`` (a new one: as on
    another host): what the fleet's cache gave it, inductor's counters and the
    artifacts it dropped (``bench/support/compiled_load.py``)."""
    script = REPO / "bench/support/compiled_load.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(models_dir), "tiny-flux", "--size", "64"],
        env={**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Compiled:
    """What the first sampler compiled and shared: the fleet's key, a sampler's
    environment, the compile key's digest and the artifact's bytes."""

    key: Ed25519PrivateKey
    env: dict[str, str]
    digest: str
    artifact: bytes


@pytest.fixture(scope="module")
def compiled(model_store: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    """A sampler's first compile of the model: a miss, compiled here, then shared
    with a record the fleet's key signed."""
    key_file = compile_signing_key(tmp_path_factory.mktemp("secrets"))
    signing = SamplerSettings.from_env({SIGNING: str(key_file)}).compile_signing_key
    assert signing is not None
    env = {**model_store.sampler_env(), SIGNING: str(key_file)}  # as `darkroom up --model-store` gives its samplers
    writer = store_of(model_store.env())
    before = set(writer.compiled_names())
    first = load_in_new_process(models_dir, tmp_path_factory.mktemp("host-a"), env)
    assert first["result"] == CacheResult.MISS.value and first["inductor"].get("fxgraph_cache_miss", 0) > 0
    shared = set(writer.compiled_names()) - before
    [digest] = {name.removesuffix(RECORD_SUFFIX) for name in shared}
    assert shared == {digest, digest + RECORD_SUFFIX}
    artifact = writer.read_compiled(digest)
    assert artifact is not None
    record = verified_artifact(
        writer.read_compiled(digest + RECORD_SUFFIX) or b"", artifact, signing.key.public_key(), digest
    )
    assert (record.worker, record.artifact_bytes) == ("compiled-load", len(artifact))
    return Compiled(signing.key, env, digest, artifact)


def signed_record(digest: str, artifact: bytes, key: Ed25519PrivateKey) -> bytes:
    return signed(record_of(digest, artifact, worker="elsewhere", published_at=WHEN, key=key), key)


def provenance_of(host: Path, digest: str) -> Path:
    return host / PROVENANCE_DIR / f"{digest}.json"


# Two cold inductor compiles and a load, each in a new process: about 120 s alone on
# two cores, and 2.5 times that beside the suite's other workers; the suite's 300 s
# is a hang detector, which this module's own work would trip.
@pytest.mark.timeout(900)
def test_a_second_process_loads_the_fleets_artifacts_and_a_removed_one_is_dropped_from_its_host(
    compiled: Compiled,
    model_store: Any,
    models_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    host = tmp_path / "host-b"
    second = load_in_new_process(models_dir, host, compiled.env)
    assert second["result"] == CacheResult.FLEET.value
    assert second["inductor"].get("fxgraph_cache_hit", 0) > 0 and second["inductor"].get("fxgraph_cache_miss", 0) == 0
    taken = json.loads(provenance_of(host, compiled.digest).read_text())["files"]
    assert any("/fxgraph/" in f for f in taken) and all(Path(f).is_file() for f in taken)

    # The operator lists and removes it, as the store's writer, with the fleet's key to check records with.
    for name, value in {**model_store.env(), SIGNING: compiled.env[SIGNING]}.items():
        monkeypatch.setenv(name, value)
    assert darkroom(["models", "compiled", "list"]) == 0
    [listed] = [line for line in capsys.readouterr().out.splitlines() if line.startswith(compiled.digest)]
    assert " compiled-load " in listed and listed.endswith(": verifies")
    assert darkroom(["models", "compiled", "rm", "not-a-digest"]) == 1
    assert "64 hex digits" in capsys.readouterr().err
    assert darkroom(["models", "compiled", "rm", compiled.digest]) == 0
    writer = store_of(model_store.env())
    assert compiled.digest not in writer.compiled_names()
    # And a holder of the samplers' store identity, without their key, plants it back.
    writer.write_compiled(compiled.digest, compiled.artifact)
    planted = signed_record(compiled.digest, compiled.artifact, Ed25519PrivateKey.generate())
    writer.write_compiled(compiled.digest + RECORD_SUFFIX, planted)

    # The host's next compile: what it took is dropped first, the planted artifact not loaded.
    third = load_in_new_process(models_dir, host, compiled.env)
    assert third["dropped"] == 1 and not provenance_of(host, compiled.digest).exists()
    assert third["result"] == CacheResult.UNTRUSTED.value
    assert third["inductor"].get("fxgraph_cache_hit", 0) == 0 and third["inductor"].get("fxgraph_cache_miss", 0) > 0
    # Shared again in its place, under the fleet's key.
    shared = writer.read_compiled(compiled.digest) or b""
    record = writer.read_compiled(compiled.digest + RECORD_SUFFIX) or b""
    verified_artifact(record, shared, compiled.key.public_key(), compiled.digest)


@pytest.fixture
def inductor_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's compiler cache, empty: where a load here writes."""
    root = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    return root


@pytest.mark.timeout(900)  # the module's compile, where it runs first
def test_an_artifact_its_record_does_not_vouch_for_is_not_loaded(
    compiled: Compiled, model_store: Any, inductor_cache: Path
) -> None:
    writer = store_of(model_store.env())
    cache = CompileCache(store_of(compiled.env), compiled.key, "test")
    key = compile_key("planted", torch.device("cpu"), "options", "inductor", (64, 64))
    planted, artifact = key.digest(), compiled.artifact
    other = artifact[:-1] + bytes([artifact[-1] ^ 1])
    cases = {
        "unsigned": (artifact, None),
        "another key's": (artifact, signed_record(planted, artifact, Ed25519PrivateKey.generate())),
        "other bytes": (other, signed_record(planted, artifact, compiled.key)),
        "another compile key's": (artifact, signed_record(compiled.digest, artifact, compiled.key)),
    }
    for case, (data, record) in cases.items():
        writer.write_compiled(planted, data)
        if record is None:
            writer.remove_compiled([planted + RECORD_SUFFIX])
        else:
            writer.write_compiled(planted + RECORD_SUFFIX, record)
        assert cache.load(key) is CacheResult.UNTRUSTED, case
        assert snapshot([inductor_cache]) == {}, case

    # A sampler without the key loads nothing, even what the key signed, and shares nothing.
    writer.write_compiled(planted + RECORD_SUFFIX, signed_record(planted, artifact, compiled.key))
    keyless = CompileCache(store_of(compiled.env), None, "test")
    names = writer.compiled_names()
    assert keyless.load(key) is CacheResult.LOCAL and not keyless.save(key)
    assert snapshot([inductor_cache]) == {} and writer.compiled_names() == names

    # What the key signed loads (what the cases above would have written).
    assert cache.load(key) is CacheResult.FLEET
    assert any("/fxgraph/" in path for path in snapshot([inductor_cache]))

    # Signed, and not a cache artifact: compiled here.
    writer.write_compiled(planted, b"not a cache artifact")
    writer.write_compiled(planted + RECORD_SUFFIX, signed_record(planted, b"not a cache artifact", compiled.key))
    assert cache.load(key) is CacheResult.CORRUPT


@pytest.mark.timeout(900)  # the module's compile, where it runs first
def test_a_host_drops_what_an_artifact_gave_it_once_its_record_no_longer_vouches_for_it(
    compiled: Compiled, model_store: Any, inductor_cache: Path
) -> None:
    writer = store_of(model_store.env())
    key = compile_key("dropped", torch.device("cpu"), "options", "inductor", (64, 64))
    digest, artifact = key.digest(), compiled.artifact
    writer.write_compiled(digest, artifact)
    vouching = signed_record(digest, artifact, compiled.key)
    rotated = Ed25519PrivateKey.generate()
    for case, (record, holder) in {
        "names other bytes": (signed_record(digest, b"other bytes", compiled.key), compiled.key),
        "the key changed": (vouching, rotated),
        "the sampler has no key": (vouching, None),
    }.items():
        cache = CompileCache(store_of(compiled.env), compiled.key, "test")
        writer.write_compiled(digest + RECORD_SUFFIX, vouching)
        assert cache.load(key) is CacheResult.FLEET, case
        taken = [Path(p) for p in json.loads(provenance_of(inductor_cache, digest).read_text())["files"]]
        assert taken and all(p.is_file() for p in taken), case
        cache.audit()  # the record still vouches for it: kept
        assert all(p.is_file() for p in taken), case

        writer.write_compiled(digest + RECORD_SUFFIX, record)
        CompileCache(store_of(compiled.env), holder, "test").audit()
        assert not any(p.exists() for p in taken) and not provenance_of(inductor_cache, digest).exists(), case


def test_a_key_with_nothing_under_it_misses_and_a_store_away_is_unavailable_and_changes_nothing(
    model_store: Any, tmp_path: Path, inductor_cache: Path
) -> None:
    key_file = compile_signing_key(tmp_path / "secrets")
    signing = SamplerSettings.from_env({SIGNING: str(key_file)}).compile_signing_key
    assert signing is not None
    key = compile_key("no such model", torch.device("cpu"), "options", "inductor", (64, 64))
    assert CompileCache(store_of(model_store.sampler_env()), signing.key, "test").load(key) is CacheResult.MISS

    entries = HostEntries()  # what this host loaded before, its record gone since
    with entries.recording("e" * 64, "sha"):
        entry = inductor_cache / "fxgraph" / "entry"
        entry.parent.mkdir(parents=True)
        entry.write_bytes(b"from the fleet")
    away = {**model_store.sampler_env(), "DARKROOM_MODEL_STORE_URL": "http://127.0.0.1:9"}
    assert CompileCache(store_of(away), signing.key, "test").load(key) is CacheResult.UNAVAILABLE
    assert entry.is_file() and [p.digest for p in entries.loaded()] == ["e" * 64]
