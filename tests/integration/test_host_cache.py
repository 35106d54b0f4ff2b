"""The host model cache against a real object store (seaweedfs) and real peers
(gRPC over mutual TLS): verified blobs, one fetch per host, resume, corrupt bytes
refetched and never kept, peers before the store, a peer cut mid-transfer or
trickling under the minimum rate."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.config.model_store import ModelStoreSettings
from services.mesh.pki import ROLES
from services.mesh.rpc import MeshIdentity
from services.mesh.secrets import ensure_certificates
from services.models.host_cache import HostCache
from services.models.host_cache.fleet import FleetSources
from services.models.host_cache.layout import Layout
from services.models.host_cache.peers import BLOB_CACHE_CALLERS, BlobCacheServicer, PeerSource, add_to_server
from services.models.host_cache.sources import store_only
from services.models.store.objects import ObjectStore
from services.models.store.push import push_directory
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2_grpc
from services.rpc.server import Channels, build_server

# In the quick tier (pytest -m "not slow": docs/contributing.md).
pytestmark = pytest.mark.quick

MB = 2**20


def object_store(model_store: Any) -> ObjectStore:
    env = model_store.env()
    return ObjectStore.from_settings(
        ModelStoreSettings(
            model_store_url=env["DARKROOM_MODEL_STORE_URL"],
            model_store_bucket=env["DARKROOM_MODEL_STORE_BUCKET"],
            model_store_access_key=env["DARKROOM_MODEL_STORE_ACCESS_KEY"],
            model_store_secret_key=env["DARKROOM_MODEL_STORE_SECRET_KEY"],
            model_fetch_range_mb=1,
        )
    )


def pushed(store: ObjectStore, tmp_path: Path) -> tuple[str, dict[str, bytes]]:
    """A model of three files (two with the same bytes: one blob), pushed under a fresh name."""
    big, small = os.urandom(5 * MB + 123), os.urandom(1000)
    files = {"unet/diffusion_pytorch_model.safetensors": big, "model_index.json": small, "copy/same.json": small}
    root = tmp_path / "source"
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    name = f"m{uuid.uuid4().hex[:8]}"
    push_directory(store, root, f"{name}:1")
    return name, files


def cache_of(root: Path, store: ObjectStore, sources: Any = None) -> HostCache:
    return HostCache(root, capacity_bytes=10**9, manifests=store, sources=sources or store_only(store))


def assert_model(path: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (path / rel).read_bytes() == data


async def test_a_model_resolves_into_verified_hard_links_fetched_once(model_store: Any, tmp_path: Path) -> None:
    store = object_store(model_store)
    name, files = pushed(store, tmp_path)
    cache = cache_of(tmp_path / "host", store)
    path = await cache.resolve(name, "1")
    assert_model(path, files)
    unet = path / "unet/diffusion_pytorch_model.safetensors"
    blob = cache.layout.blob(next(d for d in cache.layout.complete_blobs() if cache.layout.blob(d).stat().st_size > MB))
    assert unet.stat().st_ino == blob.stat().st_ino  # loaded from the blob itself, no copy
    assert cache.fetched["store"] == 5 * MB + 123 + 1000
    assert await cache.resolve(name, None) == path  # "latest", and a hit
    assert cache.fetched["store"] == 5 * MB + 123 + 1000


async def test_a_partial_download_resumes_and_a_corrupt_one_is_fetched_again(model_store: Any, tmp_path: Path) -> None:
    store = object_store(model_store)
    name, files = pushed(store, tmp_path)
    big = files["unet/diffusion_pytorch_model.safetensors"]
    manifest = store.read_manifest(name, "1")
    digest = next(f.digest for f in manifest.files if f.size == len(big))

    resumed = cache_of(tmp_path / "resumed", store)
    resumed.layout.partial(digest).write_bytes(big[: 3 * MB])
    assert_model(await resumed.resolve(name, "1"), files)
    assert resumed.fetched["store"] == len(big) - 3 * MB + 1000

    corrupt = cache_of(tmp_path / "corrupt", store)
    corrupt.layout.partial(digest).write_bytes(b"\0" * (3 * MB))
    assert_model(await corrupt.resolve(name, "1"), files)
    assert not corrupt.layout.partial(digest).exists()


def _resolve_in_a_process(root: str, env: dict[str, str], name: str, out: Any) -> None:
    class Fixture:
        def env(self) -> dict[str, str]:
            return env

    store = object_store(Fixture())
    cache = cache_of(Path(root), store)
    asyncio.run(cache.resolve(name, "1"))
    out.put(cache.fetched["store"])


async def test_two_processes_of_one_host_fetch_each_blob_once(model_store: Any, tmp_path: Path) -> None:
    store = object_store(model_store)
    name, _ = pushed(store, tmp_path)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    args = (str(tmp_path / "host"), model_store.env(), name, out)
    processes = [context.Process(target=_resolve_in_a_process, args=args) for _ in range(2)]
    for p in processes:
        p.start()
    fetched = [await asyncio.to_thread(out.get, timeout=120) for _ in processes]
    for p in processes:
        p.join(30)
        assert p.exitcode == 0
    assert sum(fetched) == 5 * MB + 123 + 1000


@pytest.fixture
async def peer(tmp_path: Path) -> AsyncIterator[tuple[Layout, str, Channels, Any]]:
    """Host A's cache served over mutual TLS, and a channel maker for a sampler of host B."""
    mesh_dir = tmp_path / "mesh"
    ensure_certificates(mesh_dir, hosts=["127.0.0.1", "localhost"], roles=ROLES)
    layout = Layout(tmp_path / "host-a")
    layout.make()
    mesh = MeshIdentity(mesh_dir, "sampler")
    server = build_server([add_to_server(layout)], "127.0.0.1", 0, mesh=mesh, roles=BLOB_CACHE_CALLERS)
    await server.grpc.start()
    channels = Channels(mesh)
    try:
        yield layout, f"127.0.0.1:{server.port}", channels, server
    finally:
        await channels.close()
        await server.grpc.stop(0)


def from_peer(store: ObjectStore, address: str, channels: Channels) -> FleetSources:
    return FleetSources.for_channels(store, channels, peers_of=lambda d: [address], leases=None, host="b")


async def test_a_second_host_fetches_from_a_peer_not_the_store(
    model_store: Any, tmp_path: Path, peer: tuple[Layout, str, Channels, Any]
) -> None:
    layout_a, address, channels, _ = peer
    store = object_store(model_store)
    name, files = pushed(store, tmp_path)
    host_a = cache_of(layout_a.root, store)
    await host_a.resolve(name, "1")
    host_b = cache_of(tmp_path / "host-b", store, from_peer(store, address, channels))
    assert_model(await host_b.resolve(name, "1"), files)
    assert host_b.fetched == {"peer": 5 * MB + 123 + 1000}


async def test_a_peer_sending_wrong_bytes_is_discarded_and_the_store_gives_them(
    model_store: Any, tmp_path: Path, peer: tuple[Layout, str, Channels, Any]
) -> None:
    layout_a, address, channels, _ = peer
    store = object_store(model_store)
    name, files = pushed(store, tmp_path)
    await cache_of(layout_a.root, store).resolve(name, "1")
    big = files["unet/diffusion_pytorch_model.safetensors"]
    rotten = next(layout_a.blob(d) for d in layout_a.complete_blobs() if layout_a.blob(d).stat().st_size == len(big))
    fd = os.open(rotten, os.O_WRONLY)
    os.pwrite(fd, b"rot", MB)  # the size unchanged: only a digest check sees it
    os.close(fd)
    host_b = cache_of(tmp_path / "host-b", store, from_peer(store, address, channels))
    assert_model(await host_b.resolve(name, "1"), files)
    assert host_b.fetched["store"] == len(big)


class CuttingServicer(BlobCacheServicer):
    """Host A's real servicer, whose every stream of the big blob is cut off (ends
    UNAVAILABLE) once two chunks of it went out, the first of them its first bytes:
    the ranges after the first wait for it, so that what the host keeps (the bytes
    unbroken from the start) is never nothing, whichever stream runs first. (The
    server is not stopped from within its own call: grpcio may crash doing that.)"""

    def __init__(self, layout: Layout, big: str) -> None:
        super().__init__(layout)
        self.big = big
        self.sent = 0
        self.head_sent = asyncio.Event()

    async def ReadBlob(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if request.digest == self.big and request.offset > 0:
            await self.head_sent.wait()
        async for chunk in super().ReadBlob(request, context):
            if request.digest == self.big and self.sent >= 2:  # the third is never sent
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the peer went away")
            self.sent += request.digest == self.big
            yield chunk
            if request.digest == self.big and request.offset == 0:
                self.head_sent.set()


async def test_a_peer_cut_mid_transfer_is_finished_from_the_store(model_store: Any, tmp_path: Path) -> None:
    store = object_store(model_store)
    name, files = pushed(store, tmp_path)
    layout_a = Layout(tmp_path / "host-a")
    await cache_of(layout_a.root, store).resolve(name, "1")
    big_digest = hashlib.sha256(files["unet/diffusion_pytorch_model.safetensors"]).hexdigest()
    servicer = CuttingServicer(layout_a, big_digest)
    registration = (lambda s: sampler_pb2_grpc.add_BlobCacheServicer_to_server(servicer, s), "BlobCache")
    server = build_server([registration], "127.0.0.1", 0)
    await server.grpc.start()
    channels = Channels()
    try:
        host_b = cache_of(tmp_path / "host-b", store, from_peer(store, f"127.0.0.1:{server.port}", channels))
        assert_model(await host_b.resolve(name, "1"), files)
    finally:
        await channels.close()
        await server.grpc.stop(None)
    big = len(files["unet/diffusion_pytorch_model.safetensors"])
    assert 0 < host_b.fetched["peer"] < big + 1000
    assert host_b.fetched["peer"] + host_b.fetched["store"] == big + 1000


class TricklingServicer(BlobCacheServicer):
    """Host A's real servicer, sending the big blob in small chunks, a chunk a tenth
    of a second: never idle, and about 50 KB/s (its 5 MB would take 100 s)."""

    def __init__(self, layout: Layout, big: str) -> None:
        super().__init__(layout)
        self.big = big

    async def ReadBlob(self, request: Any, context: Any) -> AsyncIterator[Any]:
        async for chunk in super().ReadBlob(request, context):
            if request.digest != self.big:
                yield chunk
                continue
            for at in range(0, len(chunk.data), 5000):
                await asyncio.sleep(0.1)
                yield type(chunk)(data=chunk.data[at : at + 5000])


async def test_a_peer_that_trickles_is_given_up_for_the_store(model_store: Any, tmp_path: Path) -> None:
    store = object_store(model_store)
    name, files = pushed(store, tmp_path)
    layout_a = Layout(tmp_path / "host-a")
    await cache_of(layout_a.root, store).resolve(name, "1")
    big = files["unet/diffusion_pytorch_model.safetensors"]
    servicer = TricklingServicer(layout_a, hashlib.sha256(big).hexdigest())
    registration = (lambda s: sampler_pb2_grpc.add_BlobCacheServicer_to_server(servicer, s), "BlobCache")
    server = build_server([registration], "127.0.0.1", 0)
    await server.grpc.start()
    channels = Channels()
    address = f"127.0.0.1:{server.port}"
    sources = FleetSources(
        store,
        peer_source=lambda a: PeerSource(a, channels, idle_s=1.0, min_bytes_per_s=MB, range_bytes=MB),
        peers_of=lambda d: [address],
        leases=None,
        host="b",
    )
    started = time.monotonic()
    try:
        host_b = cache_of(tmp_path / "host-b", store, sources)
        assert_model(await host_b.resolve(name, "1"), files)
    finally:
        await channels.close()
        await server.grpc.stop(0)
    assert time.monotonic() - started < 60  # the trickle alone takes 100 s
    assert 0 < host_b.fetched["peer"] < len(big)
    assert host_b.fetched["peer"] + host_b.fetched["store"] == len(big) + 1000
