"""Compiled once per fleet, against a real S3 server (seaweedfs) with inductor on the
CPU: a sampler process that compiles a model shares its artifacts through the model
store under the reader's identity, and a second process, its own compiler cache
empty (another host's), loads them and generates no code (inductor's graph cache
hits, and misses none); an artifact that does not load, and a key with nothing
under it, fall back to compiling, and the model still loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.config.model_store import ModelStoreSettings
from services.models.compile_cache import CacheResult, CompileCache, compile_key
from services.models.store.objects import ObjectStore

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def load_in_new_process(models_dir: Path, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    """A sampler's cold load of a small transformer miniature compiled by inductor at
    one bucket (64 px, batches of one: about 40 s of compiling on two cores), in a
    process of its own whose compiler cache is empty (as on another host): what the
    fleet's cache gave it, and inductor's counters (``bench/support/compiled_load.py``)."""
    cache_dir = tmp / f"inductor-{len(list(tmp.glob('inductor-*')))}"
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


# Two cold inductor compiles and two loads, each in a new process: about 120 s alone
# on two cores, and 2.5 times that beside the suite's other workers; the suite's
# 300 s is a hang detector, which this test's own work would trip.
@pytest.mark.timeout(900)
def test_a_second_process_loads_the_fleets_artifacts_and_compiles_nothing(
    model_store: Any, models_dir: Path, tmp_path: Path
) -> None:
    env = model_store.reader_env()  # as `darkroom up --model-store` gives its samplers
    reader = ObjectStore.from_settings(ModelStoreSettings.from_env(env))
    before = reader.compiled_digests()
    first = load_in_new_process(models_dir, tmp_path, env)
    assert first["result"] == CacheResult.MISS.value and first["inductor"].get("fxgraph_cache_miss", 0) > 0
    shared = reader.compiled_digests() - before
    assert len(shared) == 1
    second = load_in_new_process(models_dir, tmp_path, env)
    assert second["result"] == CacheResult.FLEET.value
    assert second["inductor"].get("fxgraph_cache_hit", 0) > 0 and second["inductor"].get("fxgraph_cache_miss", 0) == 0

    # (Other options are another key, with nothing under it: tests/unit/test_compile_cache.py
    # and the MISS of test_a_key_with_nothing_under_it_misses_... below; a compile costs
    # about 40 s here, so the suite does not pay for one more.)

    # An artifact that does not load: compiled again, and shared again, whole.
    writer = ObjectStore.from_settings(ModelStoreSettings.from_env(model_store.env()))
    for digest in shared:
        writer.write_compiled(digest, b"not a cache artifact")
    broken = load_in_new_process(models_dir, tmp_path, env)
    assert broken["result"] == CacheResult.CORRUPT.value and broken["inductor"].get("fxgraph_cache_miss", 0) > 0
    # Shared again in its place (that a shared artifact loads, the second process showed).
    assert all(reader.read_compiled(digest) not in (None, b"not a cache artifact") for digest in shared)


def test_a_key_with_nothing_under_it_misses_and_a_store_away_is_unavailable(model_store: Any) -> None:
    store = ObjectStore.from_settings(ModelStoreSettings.from_env(model_store.reader_env()))
    key = compile_key("no such model", torch.device("cpu"), "options", "inductor", (64, 64))
    assert CompileCache(store).load(key) is CacheResult.MISS
    away = ModelStoreSettings.from_env({**model_store.reader_env(), "DARKROOM_MODEL_STORE_URL": "http://127.0.0.1:9"})
    assert CompileCache(ObjectStore.from_settings(away)).load(key) is CacheResult.UNAVAILABLE
