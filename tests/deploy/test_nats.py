"""The NATS chart's values describe the cluster the services dial.

infra/k8s/nats-values.yaml (with an overlay's on top) makes the nodes DARKROOM_NATS_URL
lists, with TLS from the rendered Secrets and Darkroom's users included from the auth
Secret; nats-server's own parser takes the users `darkroom certs nats-users` writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.config.sections import KernelSettings
from tests.deploy.rendering import K8S, OVERLAYS, named, nats_authorization


def nats_values(overlay: str) -> dict[str, Any]:
    """infra/k8s/nats-values.yaml, with the overlay's on top where it has one (Helm's
    merge of values files: maps merged, the rest replaced)."""

    def merged(base: Any, top: Any) -> Any:
        if isinstance(base, dict) and isinstance(top, dict):
            return {
                k: merged(base[k], top[k]) if k in base and k in top else top.get(k, base.get(k)) for k in base | top
            }
        return top

    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    extra = K8S / "overlays" / overlay / "nats-values.yaml"
    return merged(values, yaml.safe_load(extra.read_text())) if extra.exists() else values


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_nats_chart_values_make_the_cluster_the_services_dial(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    values = nats_values(overlay)
    config = values["config"]
    nodes = config["cluster"]["replicas"] if config["cluster"]["enabled"] else 1
    settings = named(rendered[overlay], "ConfigMap", "darkroom-settings")["data"]
    kernel = KernelSettings.from_env(settings)
    assert kernel.nats_servers == [f"nats://nats-{i}.nats-headless:4222" for i in range(nodes)]
    assert kernel.nats_replicas == nodes
    secrets = {d["metadata"]["name"]: d["data"] for d in rendered[overlay] if d["kind"] == "Secret"}
    tls = secrets[config["nats"]["tls"]["secretName"]]
    assert {config["nats"]["tls"]["cert"], config["nats"]["tls"]["key"], values["tlsCA"]["key"]} <= set(tls)
    assert config["nats"]["tls"]["merge"]["verify"] is True and config["cluster"]["tls"]["merge"]["verify"] is True
    # The include, relative to the chart's /etc/nats-config, is the auth Secret's file.
    (include,) = [v for k, v in config["merge"].items() if k.endswith("$include")]
    (mount,) = [p["value"] for p in values["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"] if p["path"] == "/spec/volumes/-"]
    assert os.path.normpath(f"/etc/nats-config/{include}") == f"{mount['mountPath']}/auth.conf"
    assert mount["name"] == volume["name"] and "auth.conf" in secrets[volume["secret"]["secretName"]]


def test_nats_server_takes_the_users_darkroom_makes(mesh: Path, tmp_path: Path) -> None:
    """The chart's configuration with the include infra/k8s/README.md sets up, tested by
    nats-server's own parser."""
    server = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")
    assert server is not None
    (tmp_path / "nats-auth").mkdir()
    (tmp_path / "nats-auth" / "auth.conf").write_text(
        nats_authorization(mesh, ["darkroom-sampler-0", "darkroom-sampler-1"])
    )
    config = tmp_path / "nats-config" / "nats.conf"
    config.parent.mkdir()
    values = nats_values("fleet")
    (include,) = [v for k, v in values["config"]["merge"].items() if k.endswith("$include")]
    config.write_text(f"port: 4222\ninclude {include};\n")
    done = subprocess.run([server, "-t", "-c", str(config)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "nats-auth" / "auth.conf").write_text("authorization: {users: [")
    assert subprocess.run([server, "-t", "-c", str(config)], capture_output=True, timeout=30).returncode != 0
