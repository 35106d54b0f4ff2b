"""The secrets of one machine's stack in one directory (``DATA_DIR/secrets``):
the fleet CA, a certificate per role for this machine's names, NATS users'
passwords, the database password and the samplers' key for signing compiled
artifacts. ``darkroom up`` makes what is missing on its first start and keeps it;
a certificate near its end is issued again."""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Iterable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.mesh.pki import ROLES, CertificateAuthority, CertPaths, PkiError, expires_at, local_hosts, write_private

# A certificate with less left than this is issued again at the next start.
RENEW_BEFORE = dt.timedelta(days=30)
DATABASE_USER = "postgres"
COMPILE_SIGNING_KEY_FILE = "compile-signing.key"


def ensure_certificates(mesh_dir: Path, hosts: Iterable[str] | None = None, roles: Iterable[str] = ROLES) -> None:
    """The CA (made if there is none) and a certificate for each of ``roles`` on
    ``hosts`` (this machine's names by default), issued where missing or ending
    within ``RENEW_BEFORE``."""
    mesh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    mesh_dir.chmod(0o700)
    if (mesh_dir / "ca.key").exists():
        ca = CertificateAuthority.load(mesh_dir)
    else:
        ca = CertificateAuthority.create()
        ca.save(mesh_dir)
    names = list(hosts) if hosts is not None else local_hosts()
    soon = dt.datetime.now(dt.UTC) + RENEW_BEFORE
    for role in roles:
        paths = CertPaths.of(mesh_dir, role)
        try:
            fresh = paths.key.exists() and expires_at(paths.cert.read_bytes()) > soon
        except (OSError, ValueError):
            fresh = False
        if not fresh:
            ca.issue_into(mesh_dir, role, names)


def password(path: Path) -> str:
    """The password kept in ``path``, made (random, 0600) if there is none."""
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    # Hex rather than URL-safe base64: one that began with "-" was read as an option
    # where it was passed as an argument (pg_autoctl's, once in 64 passwords).
    made = secrets.token_hex(24)
    write_private(path, made.encode() + b"\n")
    return made


def compile_signing_key(mesh_dir: Path) -> Path:
    """The file of the samplers' key for the compiled artifacts they share
    (``services.models.compile_record``), made (Ed25519, PEM, 0600) if there is none;
    deleting it makes a new key at the next start, and every artifact signed with the
    old one untrusted."""
    path = mesh_dir / COMPILE_SIGNING_KEY_FILE
    if not path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_private(path, pem)
    return path


def database_password(mesh_dir: Path) -> str:
    return password(mesh_dir / "postgres.password")


def write_pgpass(mesh_dir: Path) -> Path:
    """libpq's password file for the database user (any host, port and database:
    the embedded server's port changes at each start)."""
    path = mesh_dir / "pgpass"
    secret = database_password(mesh_dir).replace("\\", "\\\\").replace(":", "\\:")
    write_private(path, f"*:*:*:{DATABASE_USER}:{secret}\n".encode())
    return path


def nats_password_path(mesh_dir: Path, user: str) -> Path:
    return mesh_dir / "nats" / f"{user}.password"


def read_nats_password(mesh_dir: Path, user: str) -> str:
    path = nats_password_path(mesh_dir, user)
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise PkiError(f"no NATS password for {user} in {path.parent}: {exc}") from exc
