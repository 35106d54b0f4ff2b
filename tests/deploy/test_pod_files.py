"""Each service finds the files it names, in the volumes its pod mounts.

Each pod's volumes laid out (sandbox.py) and its init containers run: each service
opens its mesh certificates and NATS password, the link key and the database's CA
with its own loaders, may write where it writes, and its liveness probe tells a fresh
file from a stale one. A missing file is caught, and every sampler has its NATS
password."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from http_api.signed_urls import load_key
from services.bus.credentials import NatsCredentials
from services.config.fields import Section
from services.config.sections import KernelSettings
from services.config.workers import SamplerSettings
from services.mesh.nats_auth import sampler_user
from services.mesh.rpc import MeshIdentity
from services.ops import SERVICE_MODULES
from tests.deploy.environment import container_env, load_settings, service_of
from tests.deploy.rendering import OVERLAYS, one, pods
from tests.deploy.sandbox import PodSandbox, secret_contents

# The mesh role each service presents, and its NATS user ("" where it uses no NATS,
# None where it is the sampler's own, sampler-WORKER_ID).
MESH_OF_SERVICE: dict[str, tuple[str, str | None]] = {
    "gateway": ("gateway", "gateway"),
    "scheduler": ("scheduler", "scheduler"),
    "sampler": ("sampler", None),
    "decoder": ("decoder", ""),
}


def check_files(
    service: str, kernel: KernelSettings, own: Section, sandbox: PodSandbox, container: dict[str, Any]
) -> None:
    """What the service opens at start, with its own loaders."""
    if service in MESH_OF_SERVICE:
        role, user = MESH_OF_SERVICE[service]
        identity = MeshIdentity.of(kernel.mesh_dir, role)
        assert identity is not None
        identity.server_credentials()
        identity.channel_credentials()
        if user is None:
            assert isinstance(own, SamplerSettings)
            user = sampler_user(own.worker_id)
        if user:
            assert NatsCredentials.of(kernel.mesh_dir, role, user) is not None
        # What the mesh directory links to must be mounted in this container too.
        own_roots = [p.resolve() for p in sandbox.own_paths(container)]
        for path in Path(kernel.mesh_dir).rglob("*"):
            assert any(path.resolve().is_relative_to(r) for r in own_roots), f"{service}: {path} is not mounted"
    url_key = getattr(own, "url_key_file", "")
    if url_key:
        load_key(url_key)
    if kernel.database_url:
        (root_cert,) = parse_qs(urlsplit(kernel.database_url).query)["sslrootcert"]
        assert (sandbox.root / root_cert.lstrip("/")).is_file(), f"{service}: no {root_cert}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_finds_its_files_and_may_write_where_it_writes(
    rendered: dict[str, list[dict[str, Any]]], mesh: Path, tmp_path: Path, overlay: str
) -> None:
    docs = rendered[overlay]
    secrets = secret_contents(docs, mesh)
    checked = set()
    for n, pod in enumerate(pods(docs)):
        sandbox = PodSandbox(pod, secrets, tmp_path / str(n))
        sandbox.run_init_containers(docs)
        for container in pod.spec["containers"]:
            service = service_of(container)
            assert service is not None
            env, own_names = container_env(container, pod, docs)
            kernel, own = load_settings(service, sandbox.env(env), own_names)
            check_files(service, kernel, own, sandbox, container)
            for path in (env["DARKROOM_DATA_DIR"], os.path.dirname(env["DARKROOM_LIVENESS_FILE"]), "/tmp"):
                assert sandbox.writable(container, path), f"{service} cannot write {path}"
            check_liveness_probe(container, sandbox.env(env), Path(kernel.liveness_file))
            checked.add(service)
    assert checked == set(SERVICE_MODULES)


def check_liveness_probe(container: dict[str, Any], env: Mapping[str, str], liveness_file: Path) -> None:
    """The probe's command, run on the file the service touches: content while it is
    fresh, failing once the event loop has stopped touching it for a minute."""
    command = container["livenessProbe"]["exec"]["command"]

    def probe() -> int:
        return subprocess.run(command, env={**env, "PATH": os.environ["PATH"]}, capture_output=True).returncode

    liveness_file.parent.mkdir(parents=True, exist_ok=True)
    liveness_file.touch()
    assert probe() == 0, f"{container['name']}: the liveness probe fails on a fresh file"
    old = liveness_file.stat().st_mtime - 60
    os.utime(liveness_file, (old, old))
    assert probe() != 0, f"{container['name']}: the liveness probe passes on a stale file"


def test_a_missing_mesh_file_is_caught(rendered: dict[str, list[dict[str, Any]]], mesh: Path, tmp_path: Path) -> None:
    docs = rendered["fleet"]
    secrets = secret_contents(docs, mesh)
    del secrets["darkroom-mesh-gateway"]["gateway.password"]
    (pod,) = [p for p in pods(docs) if p.labels["app.kubernetes.io/component"] == "gateway"]
    with pytest.raises(KeyError, match=r"gateway\.password"):
        PodSandbox(pod, secrets, tmp_path)
    secrets = secret_contents(docs, mesh)
    del secrets["darkroom-nats-samplers"]["sampler-darkroom-sampler-0.password"]
    (pod,) = [p for p in pods(docs) if p.labels["app.kubernetes.io/component"] == "sampler"]
    with pytest.raises(AssertionError, match="init container mesh"):
        PodSandbox(pod, secrets, tmp_path / "sampler").run_init_containers(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_sampler_has_its_nats_password(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    replicas = one(docs, "StatefulSet", "darkroom-sampler")["spec"]["replicas"]
    passwords = one(docs, "Secret", "darkroom-nats-samplers")["data"]
    assert set(passwords) == {f"sampler-darkroom-sampler-{i}.password" for i in range(replicas)}
