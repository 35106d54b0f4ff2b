"""The fixtures every deploy test shares: a mesh CA, infra/k8s with stand-in secrets,
and each overlay (and the base and the monitoring config) rendered by kustomize.

Package-scoped: one CA and one rendering for the whole package, as when these tests
were one module. Tests that change what they are given copy it first."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from services.mesh.pki import ROLES
from services.mesh.secrets import ensure_certificates
from tests.deploy.rendering import K8S, OVERLAYS, kustomizations, render, secret_file


@pytest.fixture(scope="package")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("mesh")
    ensure_certificates(directory, hosts=["darkroom.test"], roles=ROLES)
    return directory


@pytest.fixture(scope="package")
def tree(tmp_path_factory: pytest.TempPathFactory, mesh: Path) -> Path:
    """infra/k8s with a stand-in for every file a secretGenerator names."""
    copied = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copied)
    for directory, kustomization in kustomizations(copied):
        for generator in kustomization.get("secretGenerator", []):
            for entry in [*generator.get("files", []), *generator.get("envs", [])]:
                path = directory / entry.split("=")[-1]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(secret_file(path.name, mesh))
    return copied


@pytest.fixture(scope="package")
def rendered(tree: Path) -> dict[str, list[dict[str, Any]]]:
    """Each overlay as kustomize builds it, and the base and the monitoring config."""
    found = {name: render(tree / "overlays" / name) for name in OVERLAYS}
    found["base"] = render(tree / "base")
    found["monitoring"] = render(tree / "monitoring")
    return found
