"""The signed record of a fleet compile artifact (services/models/compile_record.py):
a record the fleet's key signed for the key asked for, naming these very bytes,
verifies; every other is refused before anything is loaded. The samplers' key
file: made once, private, given by `darkroom up` to samplers alone, and read by one
setting that names itself when the file is not an Ed25519 private key (tests/integration/test_compile_cache.py runs the
cache against a real store and inductor)."""

from __future__ import annotations

import base64
import hashlib
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.config.fields import SettingsError
from services.config.sections import Settings
from services.config.workers import SamplerSettings
from services.mesh.secrets import compile_signing_key
from services.models.compile_record import (
    CompileRecord,
    UntrustedArtifact,
    key_id,
    record_of,
    signed,
    unverified_record,
    verified_artifact,
    verified_record,
)
from services.ops.children import child
from services.ops.stack import LocalStack

FLEET = Ed25519PrivateKey.generate()
DIGEST = "a" * 64
ARTIFACT = b"compiled artifacts: generated code" * 100
WHEN = "2025-01-01T00:00:00+00:00"
NO_FORK_SERVER = {"DARKROOM_FORK_SERVER": "false"}  # a unit test starts no process
PEM = (serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def fleet_record(artifact: bytes = ARTIFACT, digest: str = DIGEST, key: Ed25519PrivateKey = FLEET) -> bytes:
    return signed(record_of(digest, artifact, worker="host-gpu0", published_at=WHEN, key=key), key)


def test_a_record_signed_by_the_fleets_key_for_these_bytes_verifies() -> None:
    record = verified_artifact(fleet_record(), ARTIFACT, FLEET.public_key(), DIGEST)
    assert record == CompileRecord(
        DIGEST, hashlib.sha256(ARTIFACT).hexdigest(), len(ARTIFACT), WHEN, "host-gpu0", key_id(FLEET.public_key())
    )
    assert unverified_record(fleet_record()) == record


@pytest.mark.parametrize(
    ("record", "artifact", "why"),
    [
        (fleet_record(key=Ed25519PrivateKey.generate()), ARTIFACT, "not signed by this fleet's key"),
        (fleet_record(), ARTIFACT[:-1] + b"!", "is not the one its record names"),
        (fleet_record(), ARTIFACT[:-1], "is not the one its record names"),
        (fleet_record(), ARTIFACT + b"\0", "is not the one its record names"),
        (fleet_record(digest="b" * 64), ARTIFACT, f"of the compile key {'b' * 64}, not {DIGEST}"),
        (fleet_record().split(b"\n")[0], ARTIFACT, "not signed"),
        (fleet_record()[:-20], ARTIFACT, "not signed by this fleet's key"),
        (fleet_record()[:40], ARTIFACT, "not signed"),
        (b"", ARTIFACT, "not signed"),
    ],
    ids=[
        "another key",
        "a changed byte",
        "truncated",
        "lengthened",
        "another digest",
        "unsigned",
        "cut",
        "half",
        "empty",
    ],
)
def test_every_other_record_or_artifact_is_refused(record: bytes, artifact: bytes, why: str) -> None:
    with pytest.raises(UntrustedArtifact, match=why):
        verified_artifact(record, artifact, FLEET.public_key(), DIGEST)


def test_a_signed_payload_changed_after_signing_is_refused() -> None:
    payload, signature = fleet_record().split(b"\n", 1)
    other = fleet_record(artifact=b"other bytes").split(b"\n", 1)[0]
    for forged in (other + b"\n" + signature, payload.replace(b"host-gpu0", b"host-gpu1") + b"\n" + signature):
        with pytest.raises(UntrustedArtifact, match="not signed by this fleet's key"):
            verified_record(forged, FLEET.public_key(), DIGEST)


def test_a_signed_record_of_another_shape_is_refused() -> None:
    for payload in (b"[]", b'{"key_digest": "' + DIGEST.encode() + b'"}', b"not json"):
        with pytest.raises(UntrustedArtifact, match="signed record"):
            verified_record(payload + b"\ned25519 " + base64.b64encode(FLEET.sign(payload)), FLEET.public_key(), DIGEST)


def test_the_signing_key_file_is_made_once_private_and_read_by_its_setting(tmp_path: Path) -> None:
    path = compile_signing_key(tmp_path / "secrets")
    made = path.read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert compile_signing_key(tmp_path / "secrets") == path and path.read_bytes() == made
    settings = SamplerSettings.from_env({"DARKROOM_COMPILE_SIGNING_KEY_FILE": str(path)})
    assert settings.compile_signing_key is not None
    assert settings.compile_signing_key.key.private_bytes(*PEM) == made
    assert SamplerSettings.from_env(settings.to_env()) == settings
    assert SamplerSettings().compile_signing_key is None


def test_a_key_file_that_is_not_an_ed25519_private_key_names_its_variable(tmp_path: Path) -> None:
    ec_key = tmp_path / "ec.pem"
    ec_key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(*PEM))
    public = tmp_path / "public.pem"
    public.write_bytes(
        FLEET.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    cases = {
        ec_key: "not an Ed25519 private key",
        public: "not an unencrypted PEM private key",
        tmp_path / "missing.pem": "cannot read it",
        tmp_path: "cannot read it",
    }
    for path, why in cases.items():
        with pytest.raises(SettingsError, match=f"DARKROOM_COMPILE_SIGNING_KEY_FILE='{path}': {why}"):
            SamplerSettings.from_env({"DARKROOM_COMPILE_SIGNING_KEY_FILE": str(path)})


def test_up_with_a_model_store_gives_its_samplers_alone_a_key_made_once(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"DARKROOM_DATA_DIR": str(tmp_path), "DARKROOM_MODEL_STORE_URL": "http://store:8333", **NO_FORK_SERVER}
    )
    stack = LocalStack(settings)
    stack._give_samplers_a_signing_key()  # as `darkroom up` starts, its backends up
    key_file = tmp_path / "secrets" / "compile-signing.key"
    made = key_file.read_bytes()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    for service in ("sampler", "decoder", "gateway", "scheduler", "http"):
        given = child(stack.settings, service, service).env.get("DARKROOM_COMPILE_SIGNING_KEY_FILE")
        assert given == (str(key_file) if service == "sampler" else None), service
    again = LocalStack(settings)
    again._give_samplers_a_signing_key()  # the next start: the same key
    assert again.settings.sampler == stack.settings.sampler and key_file.read_bytes() == made
    without_store = LocalStack(Settings.from_env({"DARKROOM_DATA_DIR": str(tmp_path / "other"), **NO_FORK_SERVER}))
    without_store._give_samplers_a_signing_key()
    assert without_store.settings.sampler.compile_signing_key is None
