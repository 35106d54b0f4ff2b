"""What the model store's client answers with, apart from its queries (``objects``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoredVersion:
    name: str
    version: str
    total_bytes: int
    files: int
    latest: bool
    kind: str = "model"  # or "lora": an adapter (its manifest's entry says)


@dataclass(frozen=True)
class Removal:
    versions: tuple[str, ...]
    blobs_deleted: int
    bytes_deleted: int
    blobs_kept: int  # still referenced by another version or model
