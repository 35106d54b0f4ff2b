"""The fleet's model store: a host of its own running a real S3 server (seaweedfs's
``weed mini``), the model the registry names from it (``STORE_MODEL``; the
registry is ``tests.store_registry``'s), and what the store scenarios read as an
operator would: the store's sent-bytes counter, the manifest pushed, and each GPU
host's cache."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.db.states import WorkerStatus
from services.errors import BusError
from services.models.host_cache.peers import CacheAnnouncement
from services.models.store.manifest import Manifest
from services.ops.model_store import SEALED, store_sent_bytes, wait_until_listed, weed_binary
from services.ops.store_identities import StoreIdentities, StoreIdentity, write_identities
from tests.fleet.network import Host
from tests.helpers import env_of

if TYPE_CHECKING:
    from tests.fleet.fleet import Fleet

BUCKET = "darkroom-models"
# The operator pushes as the writer; a GPU host's decoders read as the reader, which
# may not write, and its samplers as theirs, which may write compiled artifacts alone.
IDENTITIES = StoreIdentities(
    writer=StoreIdentity("fleet-writer", "fleet-writer-secret"),
    sampler=StoreIdentity("fleet-sampler", "fleet-sampler-secret"),
    reader=StoreIdentity("fleet-reader", "fleet-reader-secret"),
    gateway=StoreIdentity("fleet-gateway", "fleet-gateway-secret"),
)
WRITER, READER = IDENTITIES.writer, IDENTITIES.reader
# The model the store scenarios push: the shipped tiny one and a padding file of
# seeded random bytes, so that a transfer is long enough to measure and to cut.
STORE_MODEL = "tiny-store"
PADDING_BYTES = 64 * 1024 * 1024
# Every port named (in a namespace of its own fixed ones are free): each of weed's
# servers also binds a gRPC port, by default its port + 10000.
WEED_PORTS = {
    "master.port": 9333,
    "master.port.grpc": 19333,
    "volume.port": 8080,
    "volume.port.grpc": 18080,
    "filer.port": 8888,
    "filer.port.grpc": 18888,
    "s3.port": 8333,
    "s3.port.grpc": 18333,
    "admin.port": 23646,
    "admin.port.grpc": 33646,
    "s3.port.iceberg": 0,
    "s3.port.lance": 0,
    "metricsPort": 9327,
}


class FleetModelStore:
    """``weed mini`` on ``host``: S3 at ``url``, its bucket made, the writer's and
    the reader's identities."""

    def __init__(self, host: Host, root: Path) -> None:
        self.host = host
        self.data = root / "hosts" / host.name / "weed"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self.pushed: Pushed | None = None  # the store model, once the operator pushed it

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{WEED_PORTS['s3.port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host.address}:{WEED_PORTS['metricsPort']}/metrics"

    def settings(self) -> dict[str, object]:
        """The settings that point a GPU host's services at it: the reader, and the
        samplers' identity that `darkroom supervise` gives its samplers instead."""
        return {
            "model_store_url": self.url,
            "model_store_bucket": BUCKET,
            "model_store_access_key": READER.access_key,
            "model_store_secret_key": READER.secret_key,
            "model_store_sampler_access_key": IDENTITIES.sampler.access_key,
            "model_store_sampler_secret_key": IDENTITIES.sampler.secret_key,
        }

    def operator_settings(self) -> dict[str, object]:
        """The operator's: the reader's, and the writer's that `darkroom models push` signs with."""
        return {
            **self.settings(),
            "model_store_writer_access_key": WRITER.access_key,
            "model_store_writer_secret_key": WRITER.secret_key,
        }

    def spawn(self, logs: Path) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        address = self.host.address
        args = [
            weed_binary(), "mini", f"-dir={self.data}", f"-ip={address}", f"-ip.bind={address}",
            f"-bucket={BUCKET}", "-webdav=false", "-master.telemetry=false", *SEALED,
            f"-filer.localSocket={self.data / 'filer.sock'}", f"-s3.localSocket={self.data / 's3.sock'}",
            f"-s3.config={write_identities(self.data / 's3-identities.json', BUCKET, IDENTITIES)}",
            *(f"-{flag}={port}" for flag, port in WEED_PORTS.items()),
        ]  # fmt: skip
        self.log = logs / f"{self.host.name}-weed.log"
        self.proc = self.host.spawn(args, env={"PATH": "/usr/bin:/bin"}, log=self.log)

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until the writer lists the bucket."""
        assert self.proc is not None and self.log is not None, "spawn it first"
        wait_until_listed(self.url, BUCKET, WRITER, self.proc, self.log, timeout)

    def sent_bytes(self) -> int:
        """What its S3 server has sent for the bucket (its Prometheus counter)."""
        return store_sent_bytes(self.metrics_url, BUCKET)

    def cli(self, *args: str, env: dict[str, str]) -> str:
        """``darkroom models ARGS`` from the test process, the operator's machine."""
        done = subprocess.run(
            [sys.executable, "-m", "services.ops.cli", "models", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"darkroom models {' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout

    def manifest(self, name: str, version: str) -> tuple[Manifest, int]:
        """The version's manifest as the store holds it, and its size in bytes."""
        from services.config.model_store import ModelStoreSettings
        from services.models.store.objects import ObjectStore

        store = ObjectStore.from_settings(ModelStoreSettings(**self.settings()))  # type: ignore[arg-type]
        manifest = store.read_manifest(name, version)
        return manifest, len(manifest.to_json())


def padded_model(tiny: Path, into: Path, seed: int = 34) -> Path:
    """A copy of the tiny model's directory with ``padding.bin`` (seeded random bytes)."""
    if into.exists():
        shutil.rmtree(into)
    shutil.copytree(tiny, into, symlinks=False)
    with open(into / "padding.bin", "wb") as out:
        rng = random.Random(seed)
        for _ in range(PADDING_BYTES // (1 << 20)):
            out.write(rng.randbytes(1 << 20))
    return into


def cache_dir(root: Path, host: Host) -> Path:
    """The host's model cache (DARKROOM_MODEL_CACHE_DIR's default: DATA_DIR/model-cache)."""
    return root / "hosts" / host.name / "data" / "model-cache"


def cached_digests(root: Path, host: Host, name: str, version: str) -> dict[str, str]:
    """Each file of the version's directory in the host's cache, by path, and the
    SHA-256 of its bytes as they lie there."""
    model = cache_dir(root, host) / "models" / name / version
    found = {}
    for directory, _subdirs, names in os.walk(model):
        for file in names:
            path = Path(directory) / file
            if file.startswith("."):
                continue  # the cache's own markers (.held, .used)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
            found[path.relative_to(model).as_posix()] = digest.hexdigest()
    return found


def manifest_digests(manifest: Manifest) -> dict[str, str]:
    return {f.path: f.digest for f in manifest.files}


def partial_bytes(root: Path, host: Host) -> dict[str, int]:
    """The blobs being fetched into the host's cache, and the bytes each has so far."""
    partial = cache_dir(root, host) / "partial"
    try:
        return {p.name: p.stat().st_size for p in partial.iterdir() if p.is_file()}
    except FileNotFoundError:
        return {}


def head_written(root: Path, host: Host, digest: str, head: int = 64 * 2**10) -> bool:
    """Whether the partial blob's first ``head`` bytes have come (the padding is
    seeded random bytes: all zeros is a hole not yet written), so that a fetch cut
    now keeps bytes from the start."""
    try:
        with (cache_dir(root, host) / "partial" / digest).open("rb") as f:
            return any(f.read(head))
    except FileNotFoundError:
        return False


# The store scenarios' GPU hosts: the store model pinned (loaded before the host
# reports ready), decoded by the sampler itself (no decoder service asks the store
# for the model's VAE elsewhere), and the sampler's metrics where the test reads them.
SAMPLER_METRICS_PORT = 9100


def start_store_gpu(fleet: Fleet, host: Host) -> None:
    fleet.start_gpu(
        host,
        decoders=0,
        preload_models=(STORE_MODEL,),
        decode_locally=True,
        metrics_port=SAMPLER_METRICS_PORT,
        metrics_host=host.address,
    )


def ready_caching(fleet: Fleet, manifest: Manifest) -> set[str]:
    """The live, ready samplers whose host's cache they announce holding every blob of
    ``manifest``: a host that started with the model and has it on disk. Not whether it
    is loaded now: the warm-set planner may swap a preloaded model for the one in
    demand as soon as it is ready (under load, before a poll of the warm models sees it)."""
    try:
        heard = fleet.workers_heard()
    except BusError:
        return set()
    blobs = set(manifest.blobs())
    ready = set()
    for worker in heard:
        announced = CacheAnnouncement.of(worker)
        if worker.live and worker.status == WorkerStatus.READY and announced and blobs <= announced.blobs:
            ready.add(worker.id)
    return ready


def announcing(fleet: Fleet, digest: str) -> list[Host]:
    """The hosts whose live samplers announce ``digest`` in their cache (presence)."""
    by_address = {h.address: h for h in fleet.network}
    found: dict[str, Host] = {}
    for worker in fleet.workers_heard():
        announced = CacheAnnouncement.of(worker)
        if worker.live and announced is not None and digest in announced.blobs:
            host = by_address[worker.address.rsplit(":", 1)[0]]
            found[host.name] = host
    return [found[name] for name in sorted(found)]


def sending_to(hosts: list[Host], to: Host) -> Host | None:
    """Which of ``hosts`` is sending to ``to`` now, as ``ss`` on each shows it: the
    one whose connections to it hold the most bytes not yet acknowledged."""
    unacked = {}
    for host in hosts:
        lines = host.run(["ss", "-tnH", "state", "established", "dst", to.address]).splitlines()
        unacked[host.name] = sum(int(line.split()[1]) for line in lines if line.strip())
    busiest = max(unacked, key=lambda name: unacked[name], default=None)
    return next(h for h in hosts if h.name == busiest) if busiest and unacked[busiest] else None


_FETCHED = re.compile(r'^darkroom_model_cache_fetched_bytes_total\{source="(\w+)"\}\s+(\S+)$', re.M)


def fetched_bytes(host: Host) -> dict[str, int]:
    """The bytes the host's sampler fetched into its cache, by source (peer, store)."""
    url = f"http://{host.address}:{SAMPLER_METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {source: int(float(value)) for source, value in _FETCHED.findall(text)}


@dataclass(frozen=True)
class Pushed:
    manifest: Manifest
    manifest_bytes: int  # what a host reads to resolve it: the manifest and the latest version's name

    @property
    def blob_bytes(self) -> int:
        return sum(self.manifest.blobs().values())

    @property
    def padding_digest(self) -> str:
        return next(f.digest for f in self.manifest.files if f.path == "padding.bin")


def push_store_model(fleet: Fleet, tiny: Path) -> Pushed:
    """The operator pushes the padded tiny model with ``darkroom models push`` (once a fleet)."""
    store = fleet.model_store
    if store.pushed is None:
        model = padded_model(tiny, fleet.operator / STORE_MODEL)
        env = {**os.environ, **env_of(data_dir=fleet.operator / "data", **store.operator_settings())}
        version = store.cli("push", str(model), STORE_MODEL, env=env).strip().splitlines()[-1]
        manifest, size = store.manifest(STORE_MODEL, version)
        store.pushed = Pushed(manifest, size + len(version))
    return store.pushed
