"""Pushing a model's directory (a diffusers directory, or a builtin built for it)
to the store as ``NAME[:VERSION]``: every file hashed (SHA-256, streamed), only the
blobs the store lacks uploaded, then the manifest and the model's latest.

A version pushed again with other content is refused unless forced (``--force``).

A version not given is the first 12 hex digits of the SHA-256 of the files' list
(each file's path, size and digest, sorted by path; ``content_version``): the same
bytes always push as the same version, and any change makes another.

A registry entry then names the pushed model with ``source = "store:NAME"`` (the
latest version when the sampler resolves it) or ``source = "store:NAME:VERSION"``."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.errors import ModelError
from services.models.builtins import BUILTINS, builtin_dir, ensure_builtin
from services.models.store.errors import ModelVersionExists
from services.models.store.manifest import BlobRef, Manifest, parse_reference
from services.models.store.objects import ObjectStore

_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class PushResult:
    manifest: Manifest
    uploaded: dict[str, int]  # digest -> size: the blobs this push stored
    present: dict[str, int]  # the blobs the store already held
    replaced: Manifest | None = None  # the version's other content, which a forced push replaced

    @property
    def uploaded_bytes(self) -> int:
        return sum(self.uploaded.values())

    @property
    def present_bytes(self) -> int:
        return sum(self.present.values())


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def scan_directory(root: Path) -> tuple[BlobRef, ...]:
    """Every regular file under ``root`` (symlinks followed), by relative path.
    Hidden scratch files (a leading '.') are a builder's leftovers, not the model."""
    root = Path(root)
    if not root.is_dir():
        raise ModelError(f"{root} is not a directory")
    found = []
    for directory, subdirs, names in os.walk(root, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(directory) / name
            if name.startswith(".") or not path.is_file():
                continue
            found.append(BlobRef(path.relative_to(root).as_posix(), path.stat().st_size, file_digest(path)))
    if not found:
        raise ModelError(f"{root} holds no files")
    return tuple(sorted(found, key=lambda f: f.path))


def content_version(files: tuple[BlobRef, ...]) -> str:
    """The version a push names when none is given: its files' list, hashed."""
    listing = json.dumps([[f.path, f.size, f.digest] for f in sorted(files, key=lambda f: f.path)])
    return hashlib.sha256(listing.encode()).hexdigest()[:12]


# The denoising networks' folders whose config a model's push records in its
# manifest (``LORA_LOADERS``' networks): a gateway checks a tenant's adapter against
# it without reading any of the model's files, which it may not.
NETWORK_FOLDERS = ("unet", "transformer")
_LARGEST_CONFIG = 256 * 1024


def network_configs(root: Path) -> dict[str, Any]:
    """The entry a model's push records of its denoising network's config:
    ``{"network_configs": {"transformer/config.json": {...}}}``, or nothing."""
    found = {}
    for folder in NETWORK_FOLDERS:
        path = Path(root) / folder / "config.json"
        if path.is_file() and path.stat().st_size <= _LARGEST_CONFIG:
            try:
                found[f"{folder}/config.json"] = json.loads(path.read_text())
            except ValueError as exc:
                raise ModelError(f"{path}: not a network's config: {exc}") from exc
    return {"network_configs": found} if found else {}


def source_directory(source: str, models_dir: Path) -> Path:
    """The directory a push reads: ``source`` itself, or a builtin (``builtin:NAME``)
    built once into ``models_dir/NAME``, where `darkroom up` builds it too."""
    builtin = BUILTINS.get(source)
    if builtin is not None:
        return ensure_builtin(builtin, builtin_dir(models_dir, source))
    if source.startswith("builtin:"):
        raise ModelError(f"unknown builtin {source!r}; builtins: {', '.join(sorted(BUILTINS))}")
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ModelError(f"{source}: no such directory")
    return path


def push_directory(
    store: ObjectStore,
    root: Path,
    reference: str,
    *,
    entry: Mapping[str, Any] | None = None,
    force: bool = False,
) -> PushResult:
    """Pushes ``root`` as ``reference`` (``NAME[:VERSION]``). The name is checked
    and the files hashed before the store is touched.

    A version is what its manifest says, everywhere: pushing a version the store
    holds with other content (a fine-tune pushed over ``mymodel:prod``) is refused
    unless ``force``, and a forced push is a new manifest digest that every host's
    cache sees and rebuilds from. The same content again changes nothing but latest."""
    name, version = parse_reference(reference)
    files = scan_directory(root)
    manifest = Manifest(name, version or content_version(files), files, dict(entry or {}))
    existing = store.read_manifest_if_present(name, manifest.version)
    if existing is not None and existing.digest != manifest.digest and not force:
        raise ModelVersionExists(
            f"{name}:{manifest.version} is already in the store with other content (manifest sha256 "
            f"{existing.digest[:12]}, this push's {manifest.digest[:12]}): push it as another version, or "
            "with --force to replace it (every host then loads the new content)"
        )
    by_digest = {f.digest: f for f in files}
    uploaded: dict[str, int] = {}
    present: dict[str, int] = {}
    for digest, ref in by_digest.items():
        if store.has_blob(digest):
            present[digest] = ref.size
            continue
        store.put_blob(digest, Path(root) / ref.path)
        uploaded[digest] = ref.size
    if existing is None or existing.digest != manifest.digest:
        store.write_manifest(manifest, replace=existing is not None)
    else:
        store.point_latest(manifest.name, manifest.version)
    replaced = existing if existing is not None and existing.digest != manifest.digest else None
    return PushResult(manifest, uploaded, present, replaced)
