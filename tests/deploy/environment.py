"""The environment each Darkroom container gets, and what its service makes of it.

A container's variables as the kubelet sets them (envFrom, then env in order, with
$(VAR) expanded), parsed with the loader its service calls at start: the section its
main() hands run_service, beside the kernel's."""

from __future__ import annotations

import atexit
import base64
import importlib
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

from gpu_worker.service import check_capabilities
from services.bus.dispatch import check_worker_id
from services.config.fields import Section
from services.config.sections import KernelSettings, Settings
from services.config.workers import SamplerSettings
from services.ops import SERVICE_MODULES
from tests.deploy.rendering import SIGNING_KEY, Pod, one, pods


def section_of_each_service() -> dict[str, type[Section]]:
    """The section each service's main() hands run_service: what it reads at start,
    beside the kernel's."""
    found: dict[str, type[Section]] = {}
    for service, package in SERVICE_MODULES.items():
        module = importlib.import_module(f"{package}.service")
        with mock.patch.object(module, "run_service") as run_service:
            module.main()
        ((name, _, found[service]),) = [c.args for c in run_service.call_args_list]
        assert name == service
    return found


SECTIONS = section_of_each_service()


def service_of(container: dict[str, Any]) -> str | None:
    """The Darkroom command a container runs: `serve SERVICE`, or `migrate`."""
    if "command" in container:
        return None
    args = container.get("args", [])
    if args[:1] == ["serve"]:
        return str(args[1])
    return "migrate" if args == ["migrate"] else None


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined variables only, $$ for a dollar."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


def container_env(container: dict[str, Any], pod: Pod, docs: list[dict[str, Any]]) -> tuple[dict[str, str], set[str]]:
    """The container's environment (envFrom first, then env in order, expanded),
    with the names its own env list sets."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "secretRef" in source:
            data = one(docs, "Secret", source["secretRef"]["name"]).get("data", {})
            env.update({key: base64.b64decode(value).decode() for key, value in data.items()})
        else:
            env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    fields = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "status.podIP": "10.1.2.3"}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = "a-secret"
        else:
            raise AssertionError(f"{var['name']}: a source this test does not know")
    return env, {var["name"] for var in container.get("env", [])}


def _stand_in(data: bytes) -> str:
    made = tempfile.NamedTemporaryFile(prefix="darkroom-deploy-", delete=False)
    made.write(data)
    made.close()
    atexit.register(os.unlink, made.name)
    return made.name


# Settings read from their file as they are parsed, by a stand-in for what the pod
# mounts there, where the pod's own path is not on this machine (test_pod_files lays
# out each pod's volumes and reads the file the pod's path names).
READ_AS_PARSED = {"DARKROOM_COMPILE_SIGNING_KEY_FILE": _stand_in(SIGNING_KEY)}


def load_settings(service: str, env: Mapping[str, str], own_names: set[str]) -> tuple[KernelSettings, Section]:
    """What run_service does at start (and `darkroom migrate`), and what it cannot
    see: a DARKROOM_ variable no setting reads, silently ignored by the service."""
    env = {k: READ_AS_PARSED[k] if k in READ_AS_PARSED and not os.path.exists(v) else v for k, v in env.items()}
    kernel = KernelSettings.from_env(env)
    section: type[Section] = SECTIONS[service] if service != "migrate" else KernelSettings
    own = section.from_env(env)
    for name in env:
        if name.startswith("DARKROOM_"):
            assert name in Settings.variables(), f"{name} is read by no service"
            assert "$(" not in env[name], f"{name}={env[name]!r} refers to a variable not defined before it"
    for name in own_names:
        if name.startswith("DARKROOM_"):
            assert name in KernelSettings.variables() | section.variables(), f"{service} does not read {name}"
    if isinstance(own, SamplerSettings):
        check_worker_id(own.worker_id)
        check_capabilities(own, kernel.registry())
    return kernel, own


def darkroom_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[Pod, dict[str, Any], str]]:
    for pod in pods(docs):
        for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
            service = service_of(container)
            if service is not None:
                yield pod, container, service
