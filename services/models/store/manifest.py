"""A model version in the store: its manifest names every file of the model's
directory by path, size and SHA-256 digest, with the registry entry it was pushed
with. Files are stored once per digest (``blobs/sha256/<hex>``), so a file that did
not change between versions is neither stored nor fetched twice.

The bucket's layout:
  blobs/sha256/<hex>                 a file's bytes
  manifests/<name>/<version>.json    a version's manifest
  manifests/<name>/latest            the version last pushed, as text"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from services.errors import ModelError

MANIFEST_FORMAT = 1
# Names and versions are path segments of the bucket and of the cache.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DIGEST = re.compile(r"^[0-9a-f]{64}$")


def check_name(what: str, value: str) -> str:
    if not NAME.match(value):
        raise ModelError(f"{what} {value!r}: letters, digits, '.', '_' and '-' (at most 128), not starting with a sign")
    return value


def parse_reference(reference: str) -> tuple[str, str | None]:
    """``NAME[:VERSION]`` as (name, version or None for the latest)."""
    name, _, version = reference.partition(":")
    check_name("model name", name)
    if version:
        check_name("version", version)
    return name, version or None


BLOBS_PREFIX = "blobs/"


def blob_key(digest: str) -> str:
    return f"{BLOBS_PREFIX}sha256/{digest}"


MANIFESTS_PREFIX = "manifests/"
# Tenants' own adapters, each tenant's a store of its own under tenants/<tenant id>/
# (``ObjectStore.scoped``): the one prefix a gateway may write.
TENANTS_PREFIX = "tenants/"


def tenant_scope(tenant: str) -> str:
    """A tenant's own part of the store: a path segment (any tenant name, "." and
    ".." included, is a safe one this way) and the prefix of its adapters' names."""
    return f"tenant.{tenant}"


def tenant_prefix(tenant: str) -> str:
    """Where a tenant's own adapters lie in the bucket: a store of their own."""
    return f"{TENANTS_PREFIX}{tenant_scope(tenant)}/"


def tenant_store_name(tenant: str, name: str) -> str:
    """A tenant's adapter ``name`` as its manifest names it: never the name of
    another tenant's (its adapters' names have no '.'), nor of a model of the
    store's own (``check_operators_name``)."""
    return f"{tenant_scope(tenant)}.{name}"


def check_operators_name(name: str) -> str:
    """A name the operator pushes under: never one of the form tenants' adapters
    have in a host's cache, which holds both under their names."""
    if name.startswith(tenant_scope("")):
        raise ModelError(f"model name {name!r}: names beginning with {tenant_scope('')!r} are tenants' own")
    return name


def manifest_key(name: str, version: str) -> str:
    return f"{MANIFESTS_PREFIX}{name}/{version}.json"


def latest_key(name: str) -> str:
    return f"{MANIFESTS_PREFIX}{name}/latest"


# Compiled artifacts, by their key's digest: the one prefix samplers may write.
COMPILED_PREFIX = "compiled/"


def compiled_key(digest: str) -> str:
    return f"{COMPILED_PREFIX}{digest}"


@dataclass(frozen=True)
class BlobRef:
    """One file of a model version: where it lies in the model's directory, and its bytes' digest."""

    path: str  # relative, POSIX, without '..'
    size: int
    digest: str  # SHA-256, lower-case hex

    def __post_init__(self) -> None:
        parts = PurePosixPath(self.path).parts
        if not parts or self.path.startswith("/") or any(p in ("..", ".", "") for p in parts):
            raise ModelError(f"manifest file path {self.path!r}: must be relative, without '.' or '..'")
        if not DIGEST.match(self.digest):
            raise ModelError(f"manifest file {self.path!r}: digest {self.digest!r} is not SHA-256 hex")
        if self.size < 0:
            raise ModelError(f"manifest file {self.path!r}: size {self.size} is negative")


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    files: tuple[BlobRef, ...]
    # The registry table it was pushed with (family, dtype, sizes...), less its source.
    entry: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name("model name", self.name)
        check_name("version", self.version)
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ModelError(f"manifest of {self.name}:{self.version} names a file twice")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def blobs(self) -> dict[str, int]:
        """Each distinct digest and its size (two files with the same bytes are one blob)."""
        return {f.digest: f.size for f in self.files}

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "name": self.name,
                "version": self.version,
                "files": [{"path": f.path, "size": f.size, "sha256": f.digest} for f in self.files],
                "entry": dict(self.entry),
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @property
    def digest(self) -> str:
        """The SHA-256 of its canonical JSON: what a host checks the manifest it read against."""
        return hashlib.sha256(self.to_json()).hexdigest()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        try:
            data = json.loads(raw)
            if data.get("format") != MANIFEST_FORMAT:
                raise ModelError(f"manifest format {data.get('format')!r} is not {MANIFEST_FORMAT}")
            files = tuple(BlobRef(f["path"], int(f["size"]), f["sha256"]) for f in data["files"])
            return cls(data["name"], data["version"], files, data.get("entry", {}))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"not a model manifest: {exc}") from exc
