"""``darkroom certs``: the fleet's certificates and NATS users, for hosts that
``darkroom up`` does not make them for.

``issue ROLE HOST...`` signs a certificate for a role on a host with the CA of
the mesh directory (made there on first use) and writes ROLE.pem, ROLE.key and
ca.pem into ``--out`` (default: the mesh directory itself), for copying to that
host's mesh directory. Issuing again renews: the services read the new files at
their next handshake. ``nats-users`` makes NATS passwords for the scheduler, the
gateway, the operator and each sampler named, and prints the ``tls`` and
``authorization`` blocks for the fleet's nats-server configuration."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from services.config.sections import Settings
from services.mesh.nats_auth import CONTROL_USERS, permissions, sampler_user
from services.mesh.pki import ROLES, CertificateAuthority, CertPaths, PkiError, expires_at
from services.mesh.secrets import ensure_certificates, nats_password_path, password


def add_commands(sub: Any, run: Any) -> None:
    certs = sub.add_parser("certs", help="the sealed mesh's certificates and NATS users, for a fleet")
    actions = certs.add_subparsers(dest="certs_command", required=True)
    issue = actions.add_parser("issue", help="a certificate for a role on a host (issued again: renewed)")
    issue.add_argument("role", choices=ROLES)
    issue.add_argument("hosts", nargs="+", metavar="HOST", help="the host's names and addresses, as others dial it")
    issue.add_argument("--out", help="where to write ROLE.pem, ROLE.key and ca.pem (default: the mesh directory)")
    issue.add_argument("--days", type=int, default=397, help="how long it is valid (default 397)")
    users = actions.add_parser("nats-users", help="NATS users and the server configuration blocks that admit them")
    users.add_argument("workers", nargs="*", metavar="WORKER_ID", help="the samplers' worker ids")
    for p in (issue, users):
        p.add_argument("--data-dir", help="the mesh directory is DATA_DIR/secrets unless DARKROOM_MESH_DIR says")
        p.set_defaults(func=run)


def mesh_dir(settings: Settings) -> Path:
    kernel = settings.kernel
    return Path(kernel.mesh_dir) if kernel.mesh_dir else kernel.data_dir / "secrets"


def run(args: argparse.Namespace, settings: Settings) -> int:
    directory = mesh_dir(settings)
    try:
        if args.certs_command == "issue":
            return _issue(args, directory)
        return _nats_users(args, directory)
    except (PkiError, ValueError) as exc:
        print(f"darkroom certs: {exc}", file=sys.stderr)
        return 2


def _issue(args: argparse.Namespace, directory: Path) -> int:
    if args.days < 1:
        raise PkiError(f"--days {args.days}: must be at least 1")
    ensure_certificates(directory, roles=())  # the CA, made on first use
    out = Path(args.out).expanduser() if args.out else directory
    paths = CertificateAuthority.load(directory).issue_into(out, args.role, args.hosts, days=args.days)
    until = expires_at(paths.cert.read_bytes()).date().isoformat()
    print(f"issued {args.role} for {', '.join(args.hosts)} until {until}: {paths.cert}, {paths.key}, {paths.ca}")
    return 0


def _nats_users(args: argparse.Namespace, directory: Path) -> int:
    users = [*CONTROL_USERS, *map(sampler_user, args.workers)]
    nats = CertPaths.of(directory, "nats")
    accounts = [
        {"user": u, "password": password(nats_password_path(directory, u)), "permissions": permissions(u)}
        for u in users
    ]
    tls = {"cert_file": str(nats.cert), "key_file": str(nats.key), "ca_file": str(nats.ca), "verify": True}
    print("# nats-server: TLS with the fleet's CA, and Darkroom's users (passwords in", directory / "nats", ")")
    print("tls: " + json.dumps(tls, indent=2))
    print("authorization: " + json.dumps({"users": accounts}, indent=2))
    return 0
