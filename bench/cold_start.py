"""Time to the first image of a model pushed to the model store, through the whole
stack, on a host whose cache is empty, on one whose cache holds it, and on one whose
cache is empty while a peer's holds it: the three tiers a GPU host meets.

    python bench/cold_start.py                   # builtin:sd15-random (built on first use, ~2-4 GB)
    python bench/cold_start.py --source builtin:tiny --size 64
    python bench/cold_start.py --smoke           # CI's check that it still runs: the tiny model

One local seaweedfs (``weed mini``) holds the model; each case starts a stack of its
own (gateway, scheduler, one sampler, one decoder) and times one job from its submit
to its image stored: the fetch (if any), the load, one denoising step, the decode.

- ``empty cache``: a new host; every blob comes from the store.
- ``warm cache``: a new sampler on the first host's data directory: nothing is fetched.
- ``peer``: a new host beside a peer sampler that serves the first host's cache (it
  runs only upscales, so the job lands on the new host); blobs come from the peer.

The bytes each case took from the store (the store's own metric) and from peers
(the sampler's) are printed beside the time. Nothing here is a test."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.models.registry import DEFAULT_REGISTRY
from services.models.store.objects import ObjectStore
from services.models.store.push import push_directory, source_directory
from services.ops.model_store import EmbeddedModelStore

PROMPT = "a lighthouse on a cliff at dusk, oil painting"
STORE_MODEL = "cold-start"


@dataclass(frozen=True)
class Case:
    name: str
    seconds: float  # submit to the image stored
    store_bytes: int  # what the store sent meanwhile
    peer_bytes: int  # what the new host's sampler took from peers


def registry_file(path: Path, source: str) -> Path:
    """The shipped miniatures (tiny, the default image model; tiny-upscaler, what the
    peer runs) and ``STORE_MODEL``: the registry entry of ``source``'s builtin,
    served from the store."""
    shipped = tomllib.loads(DEFAULT_REGISTRY.read_text())["models"]
    entry = next(dict(t) for t in shipped.values() if t["source"] == source)
    entry.pop("on_request", None)
    entry.pop("default", None)
    entry["source"] = f"store:{STORE_MODEL}"
    tables = {"tiny": shipped["tiny"], "tiny-upscaler": shipped["tiny-upscaler"], STORE_MODEL: entry}
    lines = []
    for name, table in tables.items():
        lines.append(f"[models.{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in table.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def peer_bytes(stack: Any, worker: str) -> int:
    """Bytes the stack's ``worker`` sampler took from peers, from its /metrics."""
    import urllib.request

    target = next(t for t in stack.metrics_targets() if t.child == worker)
    text = urllib.request.urlopen(f"http://{target.address}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("darkroom_model_cache_fetched_bytes_total") and 'source="peer"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def first_image(
    name: str, data: Path, registry: Path, store: EmbeddedModelStore, size: int, *, peer_cache: Path | None = None
) -> Case:
    """One stack on ``data``, one job for the store's model, timed; with ``peer_cache``,
    a peer sampler serving that cache beside it."""
    from services.config.sections import Settings
    from services.ops.stack import LocalStack
    from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
    from tests.helpers import stub, wait_terminal

    env = {
        "DARKROOM_DATA_DIR": str(data),
        "DARKROOM_GATEWAY_PORT": "0",
        "DARKROOM_MODEL_REGISTRY": str(registry),
        "DARKROOM_LOG_LEVEL": "WARNING",
        **store.reader_env(),  # what its samplers and decoders read with; the push below signs as the writer
    }
    stack = LocalStack(Settings.from_env(env), cpu_workers=1, decoders=1, durable=False)
    stack.start(timeout=600)
    try:
        if peer_cache is not None:
            stack.add(
                "sampler-peer",
                "sampler",
                {
                    "DARKROOM_WORKER_ID": "peer-cpu0",
                    "DARKROOM_MODEL_CACHE_DIR": str(peer_cache),
                    "DARKROOM_CAPABILITIES": "upscale",
                    "DARKROOM_PRELOAD_MODELS": "tiny-upscaler",
                },
            )
            stack.wait_ready(120, samplers=2)
        client = stub(stack)
        sent = store.sent_bytes()
        started = time.perf_counter()
        request = pb.SubmitJobRequest(model=STORE_MODEL, prompt=PROMPT, width=size, height=size, steps=1, seed=1)
        job = wait_terminal(client, client.SubmitJob(request).job_id, timeout=1800)
        seconds = time.perf_counter() - started
        assert job.status == pb.JOB_STATUS_SUCCEEDED, job.error
        own = next(n for n in stack.services if n.startswith("sampler") and n != "sampler-peer")
        return Case(name, seconds, store.sent_bytes() - sent, peer_bytes(stack, own))
    finally:
        stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="builtin:sd15-random", help="the builtin pushed to the store")
    p.add_argument("--size", type=int, default=128, help="the image's width and height")
    p.add_argument("--data", default="", help="where the builtins are built (kept between runs); default: temp")
    p.add_argument("--smoke", action="store_true", help="the tiny model at 64 px")
    args = p.parse_args()
    if args.smoke:
        args.source, args.size = "builtin:tiny", 64
    with tempfile.TemporaryDirectory(prefix="darkroom-cold-start-") as tmp:
        root = Path(tmp)
        models = Path(args.data).expanduser() / "models" if args.data else root / "models"
        store = EmbeddedModelStore(root / "store")
        store.start()
        try:
            from services.config.sections import Settings

            objects = ObjectStore.from_settings(Settings.from_env(store.env()).kernel.model_store)
            pushed = push_directory(objects, source_directory(args.source, models), STORE_MODEL)
            registry = registry_file(root / "registry.toml", args.source)
            total = pushed.manifest.total_bytes
            print(f"{args.source} pushed as {STORE_MODEL}:{pushed.manifest.version}: {total / 1e6:.1f} MB")
            host_a, host_b = root / "host-a", root / "host-b"
            for host in (host_a, host_b):  # each a host of its own, sharing the built miniatures
                host.mkdir()
                (host / "models").symlink_to(models.resolve(), target_is_directory=True)
            cases = [
                first_image("empty cache", host_a, registry, store, args.size),
                first_image("warm cache", host_a, registry, store, args.size),
                first_image("peer", host_b, registry, store, args.size, peer_cache=host_a / "model-cache"),
            ]
        finally:
            store.stop()
    print(f"\n## Time to the first image of {args.source} from the store ({args.size} px, one step)\n")
    print("| host | first image (s) | from the store (MB) | from peers (MB) |")
    print("|---|---|---|---|")
    for c in cases:
        print(f"| {c.name} | {c.seconds:.2f} | {c.store_bytes / 1e6:.1f} | {c.peer_bytes / 1e6:.1f} |")


if __name__ == "__main__":
    main()
