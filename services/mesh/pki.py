"""The fleet's certificate authority and the certificates it issues.

One certificate per role and host: its common name is the role (what a server
checks before it lets the caller in), its subject alternative names the host's
names and addresses (what a client checks before it trusts the server). Every
certificate serves as a server and as a client: a sampler serves the scheduler's
calls and calls the decoders with the same one. Keys are ECDSA P-256; files are
written 0600 in a 0700 directory, each replaced atomically so that a reader never
sees half a renewed key."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Who may hold a certificate of the fleet's CA. The gateway, scheduler, sampler and
# decoder are Darkroom's services; nats and postgres are the stores' servers; the
# operator is a person's tools (reading the dispatch stream, health checks).
ROLES = ("gateway", "scheduler", "sampler", "decoder", "nats", "postgres", "operator")
CA_NAME = "Darkroom fleet CA"
CA_DAYS = 3650
CERT_DAYS = 397  # what browsers accept for a server certificate; renew with `darkroom certs issue`


class PkiError(Exception):
    """A certificate or key that is missing, unreadable or not the fleet's."""


@dataclass(frozen=True)
class CertPaths:
    """Where one role's certificate and key lie in a mesh directory."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def of(cls, mesh_dir: Path, role: str) -> CertPaths:
        return cls(mesh_dir / "ca.pem", mesh_dir / f"{role}.pem", mesh_dir / f"{role}.key")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA, certificate, key) as PEM bytes."""
        try:
            return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()
        except OSError as exc:
            raise PkiError(f"cannot read the mesh's certificates: {exc}") from exc

    def mtimes(self) -> tuple[float, float, float]:
        """When each file last changed: renewed certificates are noticed by this."""
        try:
            return self.ca.stat().st_mtime, self.cert.stat().st_mtime, self.key.stat().st_mtime
        except OSError:
            return 0.0, 0.0, 0.0


def check_role(role: str) -> str:
    if role not in ROLES:
        raise PkiError(f"role {role!r}: must be one of {', '.join(ROLES)}")
    return role


def local_hosts() -> list[str]:
    """The names and addresses this machine is reached by from itself."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()]
    return list(dict.fromkeys(n for n in names if n))


def write_private(path: Path, data: bytes) -> None:
    """Writes ``data`` readable by its owner only, replacing ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


class CertificateAuthority:
    """The fleet's CA: its key signs every certificate of the mesh."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert, self.key = cert, key

    @classmethod
    def create(cls, now: dt.datetime | None = None) -> CertificateAuthority:
        now = now or dt.datetime.now(dt.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, mesh_dir: Path) -> CertificateAuthority:
        try:
            cert = x509.load_pem_x509_certificate((mesh_dir / "ca.pem").read_bytes())
            key = serialization.load_pem_private_key((mesh_dir / "ca.key").read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise PkiError(f"no usable CA in {mesh_dir} (ca.pem and ca.key): {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(f"{mesh_dir / 'ca.key'} is not an EC key")
        return cls(cert, key)

    def save(self, mesh_dir: Path) -> None:
        write_private(mesh_dir / "ca.key", _key_pem(self.key))
        write_private(mesh_dir / "ca.pem", _cert_pem(self.cert))

    def issue(
        self, role: str, hosts: Iterable[str], *, days: int = CERT_DAYS, now: dt.datetime | None = None
    ) -> tuple[bytes, bytes]:
        """A certificate for ``role`` on ``hosts``: (certificate PEM, key PEM)."""
        check_role(role)
        names = list(dict.fromkeys(h.strip() for h in hosts if h.strip()))
        if not names:
            raise PkiError("a certificate needs at least one host name or address")
        now = now or dt.datetime.now(dt.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return _cert_pem(cert), _key_pem(key)

    def issue_into(self, mesh_dir: Path, role: str, hosts: Iterable[str], *, days: int = CERT_DAYS) -> CertPaths:
        """Issues and writes ``role``'s certificate and key (and the CA's certificate
        beside them), replacing what was there: a renewal."""
        cert, key = self.issue(role, hosts, days=days)
        paths = CertPaths.of(mesh_dir, role)
        write_private(paths.ca, _cert_pem(self.cert))
        write_private(paths.key, key)
        write_private(paths.cert, cert)
        return paths


def certificate_role(cert_pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(cert_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def expires_at(cert_pem: bytes) -> dt.datetime:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
