"""Compiled once per fleet: what compiling a model's networks produced
(``torch.compiler.save_cache_artifacts``: inductor's generated kernels, AOTAutograd's
graphs, autotuning results) kept in the model store under a key made of everything
that makes it valid, and loaded (``torch.compiler.load_cache_artifacts``) by every
other sampler before it compiles the same: its compilation then generates no code
(inductor's graph cache hits), and takes what tracing takes.

The key: the model's content (its files' paths and sizes, and its configs' bytes),
torch's and triton's versions, the device (a GPU's name and compute capability; a
CPU's architecture and the instructions torch uses), the speed options, the
compiler backend and the shapes the warm-up compiles. Another key misses, and the
sampler compiles as if there were no cache, then shares what it compiled. An
artifact that does not load (corrupt, of another build) is skipped the same way,
never a failed load; so is a store that cannot be reached.

Loading an artifact runs the code it holds, so it is loaded only once the record
beside it (``compiled/<digest>.record``), signed by the samplers' key, verifies
and names it (``services.models.compile_record``); any other is untrusted, not
loaded, and replaced by what this sampler compiles. A sampler without the key
neither loads nor shares. What a loaded artifact wrote into this host's compiler
cache is kept track of (``services.models.compile_provenance``), and deleted at
the next load once that artifact is found bad: deleting its record from the store
cleans every host that took it.

Within one host, inductor's own cache on disk already spares a second process the
work; without a store there is nothing more to do."""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import logging
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import Counter

from services.models.compile_provenance import HostEntries, Provenance
from services.models.compile_record import (
    RECORD_SUFFIX,
    UntrustedArtifact,
    record_of,
    signed,
    verified_artifact,
    verified_record,
)
from services.models.store.errors import ModelStoreError

log = logging.getLogger(__name__)

DROPPED = Counter(
    "darkroom_model_compile_cache_dropped",
    "Fleet compile artifacts whose files a host deleted from its compiler cache: their record gone from the store, "
    "no longer verifying under the samplers' key, or naming other bytes.",
)

# The files whose bytes are part of a model's identity; the rest (weights) by size.
_CONFIG_SUFFIXES = (".json", ".txt", ".model")


class CacheResult(enum.Enum):
    FLEET = "fleet"  # loaded from the store: the compilation generates nothing
    MISS = "miss"  # no artifact under the key: compiled here, then shared
    CORRUPT = "corrupt"  # an artifact that did not load: compiled here, then shared again
    UNTRUSTED = "untrusted"  # one its signed record does not vouch for: not loaded, compiled here, shared in its place
    UNAVAILABLE = "unavailable"  # the store did not answer: compiled here, not shared
    LOCAL = "local"  # no signing key: nothing loaded from the fleet or shared, compiled here

    @property
    def shares(self) -> bool:
        """Whether the sampler shares what it then compiles."""
        return self in (CacheResult.MISS, CacheResult.CORRUPT, CacheResult.UNTRUSTED)


@dataclass(frozen=True)
class CompileKey:
    content: str
    torch: str
    triton: str
    device: str
    options: str
    backend: str
    shapes: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def content_digest(source: Path) -> str:
    """A model directory's identity: each file's relative path and size, and the
    bytes of its configs (a weight file is named by its size: hashing gigabytes at
    each load would cost more than the compilation it saves)."""
    h = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = path.relative_to(source).as_posix()
        h.update(f"{relative}\0{path.stat().st_size}\0".encode())
        if path.suffix in _CONFIG_SUFFIXES:
            h.update(path.read_bytes())
    return h.hexdigest()


def device_identity(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}:cuda{torch.version.cuda}"
    return f"{device.type}:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"


def triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return "none"


def compile_key(content: str, device: torch.device, options: Any, backend: str, shapes: Any) -> CompileKey:
    """The key of a compilation of the model of ``content`` on ``device`` with the
    speed options ``options``, warmed up at ``shapes`` (any value with a stable repr)."""
    device_id = device_identity(device)
    return CompileKey(content, torch.__version__, triton_version(), device_id, repr(options), backend, repr(shapes))


class CompileCache:
    """The fleet's compiled artifacts in the model store (``ObjectStore``'s
    ``read_compiled`` and ``write_compiled``), each beside the record that the
    samplers' key signed (``services.models.compile_record``), published by
    ``worker``. Without a key it neither loads nor publishes."""

    def __init__(self, store: Any, signing_key: Ed25519PrivateKey | None, worker: str) -> None:
        self.store = store
        self.signing_key = signing_key
        self.worker = worker
        self.entries = HostEntries()

    def load(self, key: CompileKey) -> CacheResult:
        """Before compiling: what this host took from artifacts found bad since is
        dropped (``audit``), then the artifacts under ``key`` loaded, if their record
        verifies and they load."""
        digest = key.digest()
        self.audit()
        if self.signing_key is None:
            return CacheResult.LOCAL
        try:
            record = self.store.read_compiled(digest + RECORD_SUFFIX)
            data = self.store.read_compiled(digest)
        except ModelStoreError as exc:
            log.warning("the fleet's compile cache is unavailable (%s): compiling here", exc)
            return CacheResult.UNAVAILABLE
        if record is None and data is None:
            return CacheResult.MISS
        try:
            verified = verified_artifact(record or b"", data or b"", self.signing_key.public_key(), digest)
        except UntrustedArtifact as exc:
            log.warning("compiled artifacts %s are not loaded: %s; compiling here", digest, exc)
            return CacheResult.UNTRUSTED
        try:
            with self.entries.recording(digest, verified.artifact_sha256):
                if torch.compiler.load_cache_artifacts(data or b"") is None:
                    raise ValueError("no artifacts in it")
        except Exception as exc:  # whatever a bad artifact raises: it is only a cache
            log.warning("compiled artifacts %s do not load (%s: %s): compiling here", digest, type(exc).__name__, exc)
            return CacheResult.CORRUPT
        return CacheResult.FLEET

    def audit(self) -> None:
        """Drops the cache files this host took from each artifact found bad since
        it loaded it (``_found_bad``). A store that does not answer changes nothing."""
        for loaded in self.entries.loaded():
            try:
                why = self._found_bad(loaded)
            except ModelStoreError as exc:
                log.warning("the fleet's compile cache is unavailable (%s): what this host loaded is kept", exc)
                return
            if why is not None:
                files = self.entries.drop(loaded)
                DROPPED.inc()
                log.warning(
                    "compiled artifacts %s: %s; deleted the %d cache files it gave this host", loaded.digest, why, files
                )

    def _found_bad(self, loaded: Provenance) -> str | None:
        """Why what ``loaded`` gave this host is to be dropped: its record gone from
        the store (an operator deleted it), no longer verifying under the fleet's key
        (the key was changed; or this sampler has none), or naming other bytes now.
        None: kept."""
        if self.signing_key is None:
            return "this sampler has no signing key to check it with"
        record = self.store.read_compiled(loaded.digest + RECORD_SUFFIX)
        if record is None:
            return "its record is gone from the store"
        try:
            verified = verified_record(record, self.signing_key.public_key(), loaded.digest)
        except UntrustedArtifact as exc:
            return str(exc)
        return None if verified.artifact_sha256 == loaded.artifact_sha256 else "its record names other bytes now"

    def save(self, key: CompileKey) -> bool:
        """After compiling: this process's artifacts shared under ``key``, then
        their signed record (a reader between the two writes sees a record of other
        bytes, and compiles)."""
        if self.signing_key is None:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        digest, data = key.digest(), saved[0]
        published_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        record = record_of(digest, data, worker=self.worker, published_at=published_at, key=self.signing_key)
        try:
            self.store.write_compiled(digest, data)
            self.store.write_compiled(digest + RECORD_SUFFIX, signed(record, self.signing_key))
        except ModelStoreError as exc:
            log.warning("compiled artifacts not shared with the fleet: %s", exc)
            return False
        return True
