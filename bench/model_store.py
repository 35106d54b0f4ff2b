"""Download throughput from the model store: a model pushed to a local seaweedfs
(``weed mini`` on loopback), then every blob fetched with ``ObjectStore.read_blob``
(concurrent ranged reads written at their offsets) into files, as a host's cache
fetches them. Target: at least 500 MB/s. Then the same blobs from a peer: a host
cache serving them over mutual TLS (``BlobCache.ReadBlob``), fetched as ranges on
as many streams.

    python bench/model_store.py                        # builtin:sd15-random (built on first use, ~2-4 GB)
    python bench/model_store.py --synthetic-gb 2       # seeded random blobs instead of a model
    python bench/model_store.py --streams 4 --range-mb 8 --rounds 3
    python bench/model_store.py --smoke                # CI's check that it still runs: 64 MB, one round

Each round fetches every blob into a fresh file (the page cache, not the disk,
takes the writes: a host's NVMe is faster than loopback S3 here); the table shows
each round and the median. The bytes the store's metrics say it sent are shown
beside the bytes fetched. Nothing here is a test."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.config.model_store import ModelStoreSettings
from services.models.store.manifest import Manifest
from services.models.store.objects import ObjectStore
from services.models.store.push import push_directory, source_directory
from services.ops.model_store import EmbeddedModelStore

MB = 1024 * 1024
SEED = 1234


def synthetic_model(root: Path, total_bytes: int, *, blob_bytes: int = 512 * MB) -> Path:
    """Seeded random blobs of at most ``blob_bytes`` each, ``total_bytes`` in all:
    the same bytes on every run."""
    rng = random.Random(SEED)
    root.mkdir(parents=True, exist_ok=True)
    left, index = total_bytes, 0
    while left > 0:
        size = min(left, blob_bytes)
        with open(root / f"blob-{index:03d}.bin", "wb") as f:
            for _ in range(0, size, 64 * MB):
                f.write(rng.randbytes(min(64 * MB, size - f.tell())))
        left, index = left - size, index + 1
    return root


async def fetch_all(store: ObjectStore, manifest: Manifest, into: Path) -> int:
    """Every blob of ``manifest`` into ``into``, one after another (each with its
    own ranged reads in flight); the bytes fetched."""
    fetched = 0
    for digest, size in manifest.blobs().items():
        fd = os.open(into / digest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            await store.read_blob(digest, size, fd)
        finally:
            os.close(fd)
        fetched += size
    return fetched


async def fetch_from_peer(manifest: Manifest, root: Path, into: Path, streams: int, range_bytes: int) -> float:
    """Every blob of ``manifest`` served from a host cache holding ``root``'s files
    (``BlobCache.ReadBlob`` over mutual TLS, as between two hosts' samplers) and
    fetched into ``into`` by a ``PeerSource``; the seconds it took."""
    from services.mesh.rpc import MeshIdentity
    from services.mesh.secrets import ensure_certificates
    from services.models.host_cache.layout import Layout
    from services.models.host_cache.peers import BLOB_CACHE_CALLERS, PeerSource, add_to_server
    from services.rpc.server import Channels, build_server

    layout = Layout(into / "peer-cache")
    layout.make()
    for ref in manifest.files:
        if not layout.blob(ref.digest).exists():
            shutil.copyfile(root / ref.path, layout.blob(ref.digest))
    ensure_certificates(into / "mesh", hosts=["127.0.0.1"], roles=("sampler",))
    mesh = MeshIdentity(into / "mesh", "sampler")
    server = build_server([add_to_server(layout)], "127.0.0.1", 0, mesh=mesh, roles=BLOB_CACHE_CALLERS)
    await server.grpc.start()
    channels = Channels(mesh)
    try:
        peer = PeerSource(f"127.0.0.1:{server.port}", channels, streams=streams, range_bytes=range_bytes)
        started = time.perf_counter()
        for digest, size in manifest.blobs().items():
            fd = os.open(into / digest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                await peer.fetch(digest, size, fd, 0)
            finally:
                os.close(fd)
        return time.perf_counter() - started
    finally:
        await channels.close()
        await server.grpc.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:sd15-random", help="a builtin or a model's directory")
    parser.add_argument("--synthetic-gb", type=float, help="seeded random blobs of this many GB instead of --model")
    parser.add_argument("--streams", type=int, default=8, help="ranged reads in flight (DARKROOM_MODEL_FETCH_STREAMS)")
    parser.add_argument(
        "--range-mb", type=int, default=16, help="each ranged read's size (DARKROOM_MODEL_FETCH_RANGE_MB)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models-dir", help="where builtins are built (default: DARKROOM_DATA_DIR/models)")
    parser.add_argument("--smoke", action="store_true", help="64 MB of synthetic blobs, one round")
    args = parser.parse_args()
    if args.smoke:
        args.synthetic_gb, args.rounds = 64 * MB / 1e9, 1

    with tempfile.TemporaryDirectory(prefix="darkroom-bench-store-") as tmp:
        work = Path(tmp)
        if args.synthetic_gb:
            root, source = (
                synthetic_model(work / "model", int(args.synthetic_gb * 1e9)),
                f"synthetic {args.synthetic_gb:g} GB",
            )
        else:
            from services.config.sections import KernelSettings

            models_dir = Path(args.models_dir) if args.models_dir else KernelSettings.from_env().models_dir
            print(f"building/reading {args.model} in {models_dir}", file=sys.stderr, flush=True)
            root, source = source_directory(args.model, models_dir), args.model
        server = EmbeddedModelStore(work / "store")
        server.start()
        try:
            env = {
                **server.env(),
                "DARKROOM_MODEL_FETCH_STREAMS": str(args.streams),
                "DARKROOM_MODEL_FETCH_RANGE_MB": str(args.range_mb),
            }
            store = ObjectStore.from_settings(ModelStoreSettings.from_env(env))
            started = time.perf_counter()
            pushed = push_directory(store, root, "bench")
            push_s = time.perf_counter() - started
            manifest = pushed.manifest
            print(
                f"pushed {source}: {len(manifest.blobs())} blobs, {manifest.total_bytes / 1e9:.2f} GB "
                f"in {push_s:.1f} s",
                flush=True,
            )
            rates = []
            print("\n| source | blobs | GB | streams | range MB | round | s | MB/s | store sent GB |")
            print("|---|---|---|---|---|---|---|---|---|")
            for round_ in range(1, args.rounds + 1):
                into = work / f"fetched-{round_}"
                into.mkdir()
                sent_before = server.sent_bytes()
                started = time.perf_counter()
                fetched = asyncio.run(fetch_all(store, manifest, into))
                seconds = time.perf_counter() - started
                sent = server.sent_bytes() - sent_before
                rates.append(fetched / 1e6 / seconds)
                print(
                    f"| {source} | {len(manifest.blobs())} | {fetched / 1e9:.2f} | {args.streams} | {args.range_mb} "
                    f"| {round_} | {seconds:.2f} | {rates[-1]:.0f} | {sent / 1e9:.2f} |",
                    flush=True,
                )
                for f in into.iterdir():  # the next round writes afresh
                    f.unlink()
            print(f"\nmedian download throughput: {statistics.median(rates):.0f} MB/s (target: at least 500 MB/s)")
            into = work / "from-peer"
            into.mkdir()
            seconds = asyncio.run(fetch_from_peer(manifest, Path(root), into, args.streams, args.range_mb * MB))
            print(
                f"from a peer (mutual TLS, {args.streams} streams of {args.range_mb} MB ranges): "
                f"{sum(manifest.blobs().values()) / 1e6 / seconds:.0f} MB/s ({seconds:.2f} s)"
            )
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
