"""The model store's identities: one per role, each with only the rights its
holder uses (``role_actions``), and the seaweedfs S3 configuration that gives them
(``write_identities``)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from services.mesh.pki import write_private
from services.models.store.manifest import BLOBS_PREFIX, COMPILED_PREFIX, MANIFESTS_PREFIX, TENANTS_PREFIX

# Where `darkroom up --model-store` keeps the identities' secrets, in the mesh directory.
WRITER_SECRET_FILE = "model-store-writer.secret"
READER_SECRET_FILE = "model-store-reader.secret"
SAMPLER_SECRET_FILE = "model-store-sampler.secret"
GATEWAY_SECRET_FILE = "model-store-gateway.secret"


@dataclass(frozen=True)
class StoreIdentity:
    """An S3 identity: the access key id and its secret."""

    access_key: str
    secret_key: str

    @classmethod
    def random(cls, access_key: str) -> StoreIdentity:
        return cls(access_key, secrets.token_urlsafe(24))


@dataclass(frozen=True)
class StoreIdentities:
    """An identity per role of the store (``write_identities`` gives each its rights)."""

    writer: StoreIdentity
    sampler: StoreIdentity
    reader: StoreIdentity
    gateway: StoreIdentity

    @classmethod
    def random(cls) -> StoreIdentities:
        return cls(
            StoreIdentity.random("darkroom-writer"),
            StoreIdentity.random("darkroom-sampler"),
            StoreIdentity.random("darkroom-reader"),
            StoreIdentity.random("darkroom-gateway"),
        )


def role_actions(bucket: str) -> dict[str, tuple[str, ...]]:
    """Each role's rights in ``bucket``, by the ``StoreIdentities`` field that holds
    them. The writer (the operator's) may read, list and write it all. A sampler
    reads models and adapters, and writes under ``compiled/`` alone: it shares the
    compiled artifacts of what it loaded (``services.models.compile_cache``, each
    with a signed record) and can touch no model. A decoder (the reader) reads models
    (manifests and blobs), not tenants' adapters nor compiled artifacts. The
    gateway, facing the internet, reads and lists manifests (the adapters a request
    names, and those it lists) and keeps tenants' own
    adapters under ``tenants/``: it reads no model's bytes, and writes no model,
    manifest or compiled artifact. Nobody else lists the bucket, nor may any make or
    delete buckets, nor touch another."""
    return {
        "writer": (f"Read:{bucket}", f"List:{bucket}", f"Write:{bucket}"),
        "sampler": (f"Read:{bucket}", f"Write:{bucket}/{COMPILED_PREFIX}*"),
        "reader": tuple(f"Read:{bucket}/{prefix}*" for prefix in (MANIFESTS_PREFIX, BLOBS_PREFIX)),
        "gateway": (
            *(f"{right}:{bucket}/{MANIFESTS_PREFIX}*" for right in ("Read", "List")),
            *(f"{right}:{bucket}/{TENANTS_PREFIX}*" for right in ("Read", "List", "Write")),
        ),
    }


def write_identities(path: Path, bucket: str, identities: StoreIdentities) -> Path:
    """seaweedfs's S3 identities (``-s3.config``, 0600), each with its role's rights
    (``role_actions``)."""

    def identity(who: StoreIdentity, actions: tuple[str, ...]) -> dict[str, object]:
        return {
            "name": who.access_key,
            "credentials": [{"accessKey": who.access_key, "secretKey": who.secret_key}],
            "actions": list(actions),
        }

    config = {
        "identities": [identity(getattr(identities, role), actions) for role, actions in role_actions(bucket).items()]
    }
    write_private(path, json.dumps(config, indent=2).encode())
    return path
