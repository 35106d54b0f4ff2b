"""A ``store:`` model through a running stack, against a real object store
(seaweedfs): two samplers of one host preload it through their shared host cache
(each blob sent by the store once), a job for it completes, the cache holds the
manifest's digests and the samplers' heartbeats announce them. And the warm
planner's prefetch: a planned store model ends up in the cache (then loaded,
from disk) with no job for it."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from gpu_worker.engine import SamplerEngine
from gpu_worker.models.prefetch import Prefetcher
from gpu_worker.plan_follower import follow_plan
from services.db.worker_records import WarmPlan
from services.models.host_cache import loading
from services.models.host_cache.layout import Layout
from services.models.registry import ModelRegistry
from services.models.store.manifest import Manifest
from services.models.store.push import push_directory
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import make_stack, running
from tests.helpers import store_values, stub, wait_for, wait_terminal, workers_heard
from tests.integration.test_host_cache import cache_of, object_store
from tests.store_registry import write_store_registry

pytestmark = pytest.mark.integration

MODEL = "tiny-store"


def push_tiny(model_store: Any, models_dir: Path) -> Manifest:
    """The tiny builtin pushed under a name of its own (the store is the session's)."""
    return push_directory(object_store(model_store), models_dir / "tiny", f"tiny{uuid.uuid4().hex[:8]}").manifest


@pytest.fixture(scope="module")
def pushed(model_store: Any, models_dir: Path) -> Manifest:
    return push_tiny(model_store, models_dir)


@pytest.fixture(scope="module")
def sent_at_start(model_store: Any, pushed: Manifest) -> int:
    return int(model_store.sent_bytes())


@pytest.fixture(scope="module")
def store_stack(
    tmp_path_factory: pytest.TempPathFactory,
    postgres: EmbeddedPostgres,
    models_dir: Path,
    model_store: Any,
    pushed: Manifest,
    sent_at_start: int,
) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("store-stack")
    registry = write_store_registry(tmp / "registry.toml", MODEL, pushed.name)
    yield from running(
        make_stack(
            tmp / "stack",
            postgres,
            models_dir,
            samplers=2,
            model_registry=registry,
            preload_models=(MODEL,),  # both samplers resolve it at once as they start
            **store_values(model_store),  # each role its own identity, as `darkroom up --model-store` gives them
        )
    )


def blob_bytes(manifest: Manifest) -> int:
    return sum(manifest.blobs().values())


def test_two_samplers_of_a_host_preload_it_with_each_blob_sent_once(
    store_stack: LocalStack, model_store: Any, pushed: Manifest, sent_at_start: int
) -> None:
    layout = Layout(store_stack.settings.kernel.model_cache_dir)
    assert set(pushed.blobs()) <= set(layout.complete_blobs())
    assert (layout.model(pushed.name, pushed.version) / "model_index.json").exists()
    # Each blob once, and the manifests (each sampler reads its own, and the decoder may).
    sent = model_store.sent_bytes() - sent_at_start
    assert blob_bytes(pushed) <= sent <= blob_bytes(pushed) + 4 * len(pushed.to_json())
    samplers = wait_for(
        lambda: [w for w in workers_heard(store_stack.settings.kernel).values() if w.kind == "sampler"],
        lambda ws: (
            len(ws) == 2
            and all(set(pushed.blobs()) <= set(w.telemetry.get("model_cache", {}).get("blobs", ())) for w in ws)
        ),
        timeout=30,
        what="both samplers to announce the model's blobs",
    )
    assert {w.telemetry["model_cache"]["host"] for w in samplers} == {layout.host_id()}  # one host: one cache


def test_a_job_for_the_store_model_completes_from_the_cache(
    store_stack: LocalStack, model_store: Any, pushed: Manifest
) -> None:
    sent_before = model_store.sent_bytes()
    client = stub(store_stack)
    reply = client.SubmitJob(
        pb.SubmitJobRequest(model=MODEL, prompt="a lighthouse", width=64, height=64, steps=2, seed=3)
    )
    job = wait_terminal(client, reply.job_id)
    assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
    assert model_store.sent_bytes() - sent_before < blob_bytes(pushed)  # no blob fetched again


async def test_a_planned_store_model_is_prefetched_without_a_job(
    model_store: Any, models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = push_tiny(model_store, models_dir)
    registry = ModelRegistry.load(write_store_registry(tmp_path / "registry.toml", MODEL, manifest.name))
    cache = cache_of(tmp_path / "cache", object_store(model_store))
    monkeypatch.setattr(loading, "_installed", None)  # put back after: the installed cache is the process's
    loading.install(cache, asyncio.get_running_loop())
    engine = SamplerEngine(registry, models_dir, torch.device("cpu"))
    prefetch = Prefetcher(registry, cache.resolve)
    plan = WarmPlan(MODEL, (MODEL,))
    model_dir = cache.layout.model(manifest.name, manifest.version)
    try:
        await follow_plan(plan, engine, on_drop=lambda name: None, prefetch=prefetch)
        assert engine.warm_models() == []  # not loaded while it is fetched: the idle call returned
        deadline = time.monotonic() + 60
        while not set(manifest.blobs()) <= set(cache.layout.complete_blobs()) or not model_dir.exists():
            assert time.monotonic() < deadline, "the planned model never reached the cache"
            await asyncio.sleep(0.1)
        fetched = cache.fetched["store"]
        assert fetched == blob_bytes(manifest)
        for _ in range(100):  # the prefetch's task finishes just after the directory appears
            await follow_plan(plan, engine, on_drop=lambda name: None, prefetch=prefetch)
            if engine.warm_models():
                break
            await asyncio.sleep(0.05)
        assert engine.warm_models() == [MODEL]
        assert cache.fetched["store"] == fetched  # loaded from disk
    finally:
        await prefetch.close()
        for name in engine.warm_models():
            await asyncio.to_thread(cast(Any, engine).unload, name)
