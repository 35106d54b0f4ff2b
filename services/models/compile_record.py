"""The signed record beside each compiled artifact of the fleet's compile cache
(``services.models.compile_cache``): the compile key it was made for, the
artifact's SHA-256 and size, when and by which sampler it was published, and which
key signed it, signed with the samplers' Ed25519 key. Loading an artifact runs the
code it holds, so a sampler loads only the bytes that a record signed by the
fleet's key names, for the key it asked for.

A record is its canonical JSON (sorted keys, no spaces) and a line of its
signature: ``ed25519 <base64>``. The signature covers those JSON bytes exactly, and
they are parsed only once it verifies. Pure: bytes in, a record or
``UntrustedArtifact`` out."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import asdict, dataclass, fields

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from services.errors import ModelError

RECORD_SUFFIX = ".record"  # compiled/<digest>.record beside compiled/<digest>
_SIGNATURE = b"ed25519 "


class UntrustedArtifact(ModelError):
    """A compiled artifact the fleet's key does not vouch for: no record, a record
    not signed by that key, one of another compile key, or other bytes than it names."""


@dataclass(frozen=True)
class CompileRecord:
    key_digest: str  # CompileKey.digest() of the compilation
    artifact_sha256: str
    artifact_bytes: int
    published_at: str  # ISO 8601, UTC
    worker: str  # the sampler that compiled it
    signer: str  # key_id() of the key that signed it

    def canonical(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


# Each field's type, as a signed payload must hold it.
_KINDS = {f.name: {"str": str, "int": int}[str(f.type)] for f in fields(CompileRecord)}


def key_id(key: Ed25519PublicKey) -> str:
    """A key's short name in records and logs: 16 hex digits of its SHA-256."""
    return hashlib.sha256(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()[:16]


def record_of(digest: str, artifact: bytes, *, worker: str, published_at: str, key: Ed25519PrivateKey) -> CompileRecord:
    return CompileRecord(
        digest, hashlib.sha256(artifact).hexdigest(), len(artifact), published_at, worker, key_id(key.public_key())
    )


def signed(record: CompileRecord, key: Ed25519PrivateKey) -> bytes:
    """The record's bytes as stored: its canonical JSON and its signature by ``key``."""
    payload = record.canonical()
    return payload + b"\n" + _SIGNATURE + base64.b64encode(key.sign(payload)) + b"\n"


def verified_record(data: bytes, key: Ed25519PublicKey, digest: str) -> CompileRecord:
    """The record in ``data`` once its signature verifies under ``key`` and it is
    of the compile key ``digest``; UntrustedArtifact saying why not otherwise."""
    payload, line = _split(data)
    if not line.startswith(_SIGNATURE):
        raise UntrustedArtifact("its record is not signed (no signature line)")
    try:
        key.verify(base64.b64decode(line.removeprefix(_SIGNATURE), validate=True), payload)
    except (binascii.Error, InvalidSignature):
        raise UntrustedArtifact(f"its record is not signed by this fleet's key ({key_id(key)})") from None
    record = _parse(payload)
    if record.key_digest != digest:
        raise UntrustedArtifact(f"its record is of the compile key {record.key_digest}, not {digest}")
    return record


def verified_artifact(record: bytes, artifact: bytes, key: Ed25519PublicKey, digest: str) -> CompileRecord:
    """The record, verified (``verified_record``), once ``artifact`` is the very
    bytes it names (size and SHA-256)."""
    found = verified_record(record, key, digest)
    sha256 = hashlib.sha256(artifact).hexdigest()
    if (len(artifact), sha256) != (found.artifact_bytes, found.artifact_sha256):
        raise UntrustedArtifact(
            f"the artifact ({len(artifact)} bytes, sha256 {sha256[:12]}) is not the one its record names "
            f"({found.artifact_bytes} bytes, sha256 {found.artifact_sha256[:12]})"
        )
    return found


def unverified_record(data: bytes) -> CompileRecord:
    """What a stored record says, its signature unchecked: for showing, never for
    trusting."""
    return _parse(_split(data)[0])


def _split(data: bytes) -> tuple[bytes, bytes]:
    """A stored record's payload and its signature line (empty where there is none)."""
    payload, newline, line = data.removesuffix(b"\n").rpartition(b"\n")
    return (payload, line) if newline else (data, b"")


def _parse(payload: bytes) -> CompileRecord:
    """A signed payload's record: every field, of its type, and nothing else (a
    record of a later format is refused, not half read)."""
    try:
        values = json.loads(payload)
    except ValueError:
        raise UntrustedArtifact("its signed record is not JSON") from None
    if (
        not isinstance(values, dict)
        or set(values) != set(_KINDS)
        or not all(type(values[name]) is kind for name, kind in _KINDS.items())
    ):
        raise UntrustedArtifact(f"its signed record does not hold exactly {', '.join(sorted(_KINDS))}")
    return CompileRecord(**values)
