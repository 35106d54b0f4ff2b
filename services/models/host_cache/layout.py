"""Where things lie in a host's cache directory. Every path is made from a checked
digest, name or version, so nothing read from a manifest or a peer's request can
point outside the cache.

  blobs/sha256/<hex>              a complete blob, its SHA-256 verified
  partial/<hex>                   a blob being fetched (resumed from its size)
  models/<name>/<version>/...     the version's directory: hard links to blobs
  models/<name>/<version>/.held   shared-locked by each sampler holding it loaded
  models/<name>/<version>/.used   its mtime: when it was last resolved (LRU)
  models/<name>/<version>/.manifest-sha256  the digest of the manifest it was built from
  manifests/<name>/<version>.json the manifest it was built from (the store may be away)
  manifests/<name>/latest         the version "latest" last resolved to
  locks/                          one lock file per blob and per version, the cache's, verifying's
  trash/                          directories being deleted
  verified                        its mtime: when every blob was last hashed again
  host-id                         this host's identity among peers (one per cache dir)"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.errors import ModelError
from services.models.store.manifest import DIGEST, check_name

HELD = ".held"
USED = ".used"
BUILT_FROM = ".manifest-sha256"


def check_digest(digest: str) -> str:
    if not DIGEST.match(digest):
        raise ModelError(f"blob digest {digest!r} is not SHA-256 hex")
    return digest


@dataclass(frozen=True)
class Layout:
    root: Path

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / check_digest(digest)

    def partial(self, digest: str) -> Path:
        return self.root / "partial" / check_digest(digest)

    def model(self, name: str, version: str) -> Path:
        return self.root / "models" / check_name("model name", name) / check_name("version", version)

    def manifest(self, name: str, version: str) -> Path:
        return self.root / "manifests" / check_name("model name", name) / f"{check_name('version', version)}.json"

    def latest(self, name: str) -> Path:
        return self.root / "manifests" / check_name("model name", name) / "latest"

    def blob_lock(self, digest: str) -> Path:
        return self.root / "locks" / f"blob-{check_digest(digest)}"

    def model_lock(self, name: str, version: str) -> Path:
        return self.root / "locks" / f"model-{check_name('model name', name)}-{check_name('version', version)}"

    @property
    def cache_lock(self) -> Path:
        """Shared while a resolve fetches and builds, exclusive while blobs are evicted."""
        return self.root / "locks" / "cache"

    @property
    def trash(self) -> Path:
        return self.root / "trash"

    def discard(self, model_dir: Path) -> None:
        """A version's directory moved out of sight, then deleted: a sampler that has
        its files open (mapped) keeps them."""
        gone = self.trash / uuid.uuid4().hex
        os.rename(model_dir, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def make(self) -> None:
        for sub in ("blobs/sha256", "partial", "models", "manifests", "locks", "trash"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def host_id(self) -> str:
        """This cache's identity, made once: samplers sharing the directory are one
        host to their peers (they never ask each other)."""
        path = self.root / "host-id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            pass
        fresh = self.root / f".host-id.{uuid.uuid4().hex}"
        fresh.write_text(uuid.uuid4().hex)
        try:
            os.link(fresh, path)
        except FileExistsError:
            pass  # another sampler made it first: theirs stands
        finally:
            fresh.unlink(missing_ok=True)
        return path.read_text().strip()

    def complete_blobs(self) -> list[str]:
        """The digests of the complete blobs, for presence (what peers may ask for)."""
        try:
            return sorted(p.name for p in (self.root / "blobs" / "sha256").iterdir() if DIGEST.match(p.name))
        except FileNotFoundError:
            return []
