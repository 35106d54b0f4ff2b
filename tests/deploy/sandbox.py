"""A pod's volumes laid out in a directory, as the kubelet lays them out.

Each mount path of each container links to its volume; Secrets' files are written as
the kubelet writes them, emptyDirs start empty, and the pod's shell-script init
containers can be run in it with their environment."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.deploy.environment import container_env
from tests.deploy.rendering import Pod


def secret_contents(docs: list[dict[str, Any]], mesh: Path) -> dict[str, dict[str, bytes]]:
    """Every Secret's files: the rendered ones, and the two CloudNativePG makes."""
    found = {
        doc["metadata"]["name"]: {key: base64.b64decode(value) for key, value in doc.get("data", {}).items()}
        for doc in docs
        if doc["kind"] == "Secret"
    }
    found["darkroom-db-ca"] = {"ca.crt": (mesh / "ca.pem").read_bytes(), "ca.key": b"not to be mounted"}
    found["darkroom-db-app"] = {"password": b"a-secret", "pgpass": b"*:*:*:darkroom:a-secret"}
    return found


class PodSandbox:
    """A pod's volumes in a directory: each mount path of each container under
    ``root`` (a link to its volume), the Secrets' files written as the kubelet
    writes them (the items asked for, or every key)."""

    def __init__(self, pod: Pod, secrets: Mapping[str, Mapping[str, bytes]], root: Path) -> None:
        self.pod, self.root = pod, root
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        self.mounts: dict[str, str] = {}
        for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            for mount in container.get("volumeMounts", []):
                # A subPath mount never sees a renewed Secret.
                assert "subPath" not in mount, f"{container['name']} mounts {mount['name']} with a subPath"
                assert self.mounts.setdefault(mount["mountPath"], mount["name"]) == mount["name"]
        for path, name in self.mounts.items():
            directory = root / "volumes" / name
            if not directory.exists():
                directory.mkdir(parents=True)
                volume = volumes[name]
                if "secret" in volume:
                    files = secrets[volume["secret"]["secretName"]]
                    items = volume["secret"].get("items") or [{"key": k, "path": k} for k in files]
                    for item in items:
                        (directory / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                        (directory / item["path"]).write_bytes(files[item["key"]])
                else:
                    assert "emptyDir" in volume, f"volume {name}: a kind this test does not lay out"
            link = root / path.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(directory)

    def env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with each path under a mount moved into the sandbox."""
        moved = {}
        for name, value in env.items():
            under = [m for m in self.mounts if value == m or value.startswith(m.rstrip("/") + "/")]
            moved[name] = str(self.root / value.lstrip("/")) if under else value
        return moved

    def own_paths(self, container: dict[str, Any]) -> list[Path]:
        return [self.root / m["mountPath"].lstrip("/") for m in container.get("volumeMounts", [])]

    def writable(self, container: dict[str, Any], path: str) -> bool:
        return any(
            (path + "/").startswith(m["mountPath"].rstrip("/") + "/") and not m.get("readOnly")
            for m in container.get("volumeMounts", [])
        )

    def run_init_containers(self, docs: list[dict[str, Any]]) -> None:
        """The init containers that are shell scripts, with their environment."""
        for container in self.pod.spec.get("initContainers", []):
            if container.get("command", [])[:2] == ["sh", "-c"]:
                env, _ = container_env(container, self.pod, docs)
                script = container["command"][2]
                done = subprocess.run(["sh", "-c", script], env=self.env(env), capture_output=True, text=True)
                assert done.returncode == 0, f"init container {container['name']}: {done.stderr}"
